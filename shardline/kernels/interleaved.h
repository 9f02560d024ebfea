// The direct path that the 4-, 6- and 8-bit kernels share (int4_linear.cpp, int6_linear.cpp,
// int8_linear.cpp): 8 outputs across the vector lanes, activations as int8 per group of 32
// (shardline::int8_activations, int4_linear.cpp), each lane's 4 codes times 4 activations one integer multiply-add (VNNI's
// vpdpbusd: unsigned codes, signed activations).
//
// A layer is held as records, one per block of 8 outputs and group of 32 weights, in the order
// the kernel reads them: the group's codes for the block's 8 outputs (CODE_BYTES), then their
// scales (and los). One record after the other is one stream per thread: with codes,
// scales and los in three arrays, decode's weights (read from memory once a step) streamed at 9
// GB/s a core, as records at 13 (AVX2, SmolLM2's w13, one row). fp16 is how GGUF's blocks hold
// their scales (Q4_0, Q4_1 and Q8_0's exactly; Q4_K's products of two scales round to 2^-11),
// and a decode step at one row streams its weights at the machine's read bandwidth: a 4-bit
// record of 160 bytes rather than 192 with fp32 scales is a sixth less to read.
//
// The activations of a group are held in LANE_ORDER, the order in which a 4-bit record's nibbles
// come out of a 32-bit word (int4_linear.cpp): per 8 weights, the low nibbles of its 4 bytes are
// weights 0, 4, 1 and 5, the high nibbles 2, 6, 3 and 7. So one AND (and one shift) turn a load of
// 8 words into 8 lanes of 4 unsigned byte codes each, a "quad", whose 4 activations one 32-bit
// broadcast serves for all 8 outputs; the 6- and 8-bit records lay their codes out in the same
// order. Per row, group and 8 outputs: 8 multiply-adds of 4 products (int16 activations took 16 of
// 2, and Zen 4 issues a 512-bit one as two 256-bit halves: the instructions bound decode).
//
// Many rows (prefill, long chunks) go through a GEMM instead (`linear`, above `max_direct_rows`):
// slices of output rows dequantized on the fly, in fp32 or, where the machine measured it faster
// (kernels/choice.py, `gemm_in_bf16`), in bf16 with the activations rounded to bf16 as well.
// CPUs that compute bf16 natively (AMX, AVX-512-bf16) multiply it several times faster than fp32.
//
// Only how a record's codes and scales are held differs, and a `Codes` type says it (AVX2 first):
//   QUADS:          quads per load (a group's 8 quads take 8 / QUADS loads);
//   CODE_BYTES, SCALE_BYTES: bytes of a record's codes, and of the scales after them;
//   Word, load(r, l): load l of record r's codes; join(a, b): two records' loads side by side
//                   in a 512-bit Wide (AVX-512: block b's outputs low, b + 1's high);
//   quads(w, l, s): from load l, per lane i, the 4 byte codes of the block's output i for the
//                   group's activations 4q .. 4q + 3 in lane order, q = l * QUADS + s;
//   OFFSET, SIGNED: codes are unsigned and stand for code - OFFSET, or are signed bytes (SIGNED);
//   at(r, i, k):    output i's code for weight k of the group (the scalar paths), less OFFSET;
//   HALVES:         scales per group and output: 1, or 2 (one per 16 weights: Q6_K's);
//   scale8(r, g, h), scale_at(r, g, i, h): the 8 outputs' scales of half h, or output i's, in
//                   record r of group g;
//   LO, lo8(r, g), lo_at(r, g, i): whether the group has a lo (w = lo + scale * code), and it;
//   PER, TAIL_BYTES: records of PER groups side by side and TAIL_BYTES after them are one record
//                   of the tensor (Q4_K's: its super-block's d and dmin after its 8 groups).
// A layer's records are a tensor [N/8, K/(32 PER), STRIDE] uint8.
// `GroupScales` is the 4- and 8-bit kernels': one fp16 scale and lo per output and group.
#pragma once

#include "native.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

namespace shardline::interleaved {

constexpr int64_t G = 32;         // weights per group (one scale, one lo)
constexpr int64_t B = 8;          // outputs per block, across the lanes
// Activation rows multiplied against one block's codes at most (`multiply`): AVX-512's 32
// registers hold the sums of 8.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int64_t ROW_BLOCK = 8;
#else
constexpr int64_t ROW_BLOCK = 4;
#endif
// Of more rows, each run of ROW_BLOCK reads the weights again: a chunk of blocks about this size
// at a time, which stays in a core's L2 from the first run's read to the last's.
constexpr int64_t CHUNK_BYTES = 256 << 10;
// Chunks a thread claims at least, where a layer is small: a thread holds its next chunk while it
// works on one, so of two chunks a thread, one thread may take three while the other waits.
constexpr int64_t CHUNKS_PER_THREAD = 4;

template <typename Codes>
constexpr int64_t RECORD = Codes::CODE_BYTES + Codes::SCALE_BYTES;  // a group's
template <typename Codes>
constexpr int64_t STRIDE = Codes::PER * RECORD<Codes> + Codes::TAIL_BYTES;  // the tensor's last dimension

// Record (b, g) of a layer of `groups` groups.
template <typename Codes>
inline const char* record(const char* records, int64_t groups, int64_t b, int64_t g) {
  return records + (b * (groups / Codes::PER) + g / Codes::PER) * STRIDE<Codes> + g % Codes::PER * RECORD<Codes>;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SHARDLINE_WIDE 1
// Two blocks' 8 lanes side by side in one 512-bit register.
inline __m512i join(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
inline __m512 join(__m256 a, __m256 b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}
#endif

// A record's scales as the 4- and 8-bit kernels hold them, after its CodeBytes of codes: the 8
// outputs' fp16 scales, then their fp16 los, one grid per output and group.
template <int64_t CodeBytes>
struct GroupScales {
  static constexpr int64_t CODE_BYTES = CodeBytes;
  static constexpr int64_t SCALE_BYTES = 2 * B * sizeof(c10::Half);
  static constexpr int HALVES = 1;
  static constexpr bool LO = true;
  static constexpr int64_t PER = 1, TAIL_BYTES = 0;
  static const c10::Half* scales(const char* rec) { return reinterpret_cast<const c10::Half*>(rec + CODE_BYTES); }
  static const c10::Half* los(const char* rec) { return scales(rec) + B; }
  static float scale_at(const char* rec, int64_t, int64_t i, int) { return static_cast<float>(scales(rec)[i]); }
  static float lo_at(const char* rec, int64_t, int64_t i) { return static_cast<float>(los(rec)[i]); }
#if defined(__AVX2__)
  using Word = __m256i;
  static __m256 scale8(const char* rec, int64_t, int) { return load_half8(scales(rec)); }
  static __m256 lo8(const char* rec, int64_t) { return load_half8(los(rec)); }
#if defined(SHARDLINE_WIDE)
  using Wide = __m512i;
  static __m512i join(__m256i a, __m256i b) { return interleaved::join(a, b); }
#endif
#endif
};

// The codes of one record as a packer gathers them: codes[i][k], output i's for weight k of the
// group (zeros for a padded block's rows).
using RecordCodes = uint8_t[B][G];

// The low nibbles of 8 bytes (codes of weights 0..7 of a load) as int4_linear.cpp's word: weight
// 2p's at bits 4p, weight 2p + 1's at 16 + 4p. Shifts and masks rather than a loop a weight, since
// packing every layer this way is most of a first start's conversion.
inline uint32_t nibble_word(uint64_t bytes) {
  constexpr uint64_t EVEN = 0x00FF00FF00FF00FFull;
  bytes &= 0x0F0F0F0F0F0F0F0Full;
  uint64_t even = bytes & EVEN, odd = (bytes >> 8) & EVEN;  // nibbles at bits 0, 16, 32, 48
  even = (even | even >> 12) & 0x000000FF000000FFull, odd = (odd | odd >> 12) & 0x000000FF000000FFull;
  even = (even | even >> 24) & 0xFFFF, odd = (odd | odd >> 24) & 0xFFFF;
  return static_cast<uint32_t>(even | odd << 16);
}

// A record's 4-bit codes, the low nibbles of `codes`: 4 loads of the 8 outputs' words.
inline void write_nibbles(char* rec, const RecordCodes& codes) {
  uint32_t* words = reinterpret_cast<uint32_t*>(rec);
  for (int64_t i = 0; i < B; ++i)
    for (int64_t l = 0; l < G / 8; ++l) {
      uint64_t bytes;
      std::memcpy(&bytes, codes[i] + 8 * l, 8);
      words[l * B + i] = nibble_word(bytes);
    }
}

// A layer's records [N/8, K/32, RECORD] uint8: `pack_record(record, b, g)` writes block b's
// codes and scales of group g into the record.
template <typename Codes, typename PackRecord>
at::Tensor pack(const at::TensorOptions& options, int64_t N, int64_t K, PackRecord pack_record) {
  const int64_t groups = K / G;
  at::Tensor out = at::empty({N / B, groups / Codes::PER, STRIDE<Codes>}, options.dtype(at::kByte));
  char* base = reinterpret_cast<char*>(out.data_ptr<uint8_t>());
  at::parallel_for(0, N / B, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t g = 0; g < groups; ++g) pack_record(const_cast<char*>(record<Codes>(base, groups, b, g)), b, g);
  });
  return out;
}

// A tensor's rows of GGUF blocks [N, K/256 * BYTES] uint8 (Q4_K's, Q6_K's), as a packer reads them.
struct BlockRows {
  at::Tensor raw;  // contiguous
  int64_t N, row_bytes, K;
  const uint8_t* data;
  // the block of row r holding group g (of 32 weights) of the row
  const uint8_t* block(int64_t r, int64_t g, int64_t bytes) const { return data + r * row_bytes + g / 8 * bytes; }
};
inline BlockRows block_rows(const at::Tensor& blocks, int64_t bytes, const char* kind) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.size(1) % bytes == 0, kind,
              " blocks must be [N, K/256 * ", bytes, "] uint8");
  at::Tensor raw = blocks.contiguous();
  const uint8_t* data = raw.const_data_ptr<uint8_t>();
  return {raw, raw.size(0), raw.size(1), raw.size(1) / bytes * 256, data};
}

// The same for `GroupScales` records: `pack_codes(record, b, g)` writes the codes, and the
// scales and los [N, K/32], rounded to fp16, follow them.
template <typename Codes, typename PackCodes>
at::Tensor pack(const at::Tensor& scale, const at::Tensor& lo, int64_t N, int64_t K, PackCodes pack_codes) {
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.size(1) == K / G && lo.sizes() == scale.sizes(),
              "scale and lo must be [N, K/32]");
  const at::Tensor s = scale.to(at::kHalf).contiguous(), z = lo.to(at::kHalf).contiguous();
  const int64_t groups = K / G;
  const c10::Half* sp = s.const_data_ptr<c10::Half>();
  const c10::Half* zp = z.const_data_ptr<c10::Half>();
  return pack<Codes>(scale.options(), N, K, [&](char* rec, int64_t b, int64_t g) {
    pack_codes(rec, b, g);
    c10::Half* f = reinterpret_cast<c10::Half*>(rec + Codes::CODE_BYTES);
    for (int64_t i = 0; i < B; ++i) f[i] = sp[(b * B + i) * groups + g], f[B + i] = zp[(b * B + i) * groups + g];
  });
}

// The blocks of 8 outputs that a thread multiplies, as units (unit u: block u % blocks of layer
// u / blocks): the chunk of them it works on, [begin, end), and the one it has claimed next, so
// that its prefetches run on from one chunk's blocks into the next's (another layer's, maybe).
struct Units {
  const std::vector<const char*>& layers;  // each layer's records
  int64_t blocks, groups;
  int64_t end, next, next_end;  // past the chunk's last unit; the next chunk's (empty: none)
  // the first record of unit u's block, u counted on from the chunk into the next (the last
  // block, past both)
  template <typename Codes>
  const char* at(int64_t u) const {
    if (u >= end) u = next < next_end ? std::min(next + (u - end), next_end - 1) : end - 1;
    return record<Codes>(layers[u / blocks], groups, u % blocks, 0);
  }
};

// Where the activations of a group are held (the header says why): position j of each 8 holds
// weight LANE_ORDER[j] of them, and weight k is held at LANE_OF[k].
constexpr int LANE_ORDER[8] = {0, 4, 1, 5, 2, 6, 3, 7};
constexpr int LANE_OF[8] = {0, 2, 4, 6, 1, 3, 5, 7};
inline int64_t lane_position(int64_t k) { return k / 8 * 8 + LANE_OF[k % 8]; }
inline int64_t weight_at(int64_t position) { return position / 8 * 8 + LANE_ORDER[position % 8]; }

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define SHARDLINE_VNNI 1
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif

// What a record's codes stand for beyond their bytes: unsigned codes less OFFSET; signed ones
// multiply as unsigned (VNNI multiplies unsigned bytes by signed ones) 128 higher.
template <typename Codes>
constexpr int offset() { return Codes::OFFSET + (Codes::SIGNED && VNNI ? 128 : 0); }

// Row m's sum of its activations' codes over half h of group g (all of it where HALVES is 1).
inline int32_t code_sum(const Int8Rows& xs, int64_t m, int64_t groups, int64_t g, int h, int halves) {
  const int32_t* s = xs.sum16.data() + m * 2 * groups + 2 * g;
  return halves == 2 ? s[h] : s[0] + s[1];
}

inline int32_t quad_at(const int8_t* q) {  // 4 activations as one word, to broadcast
  int32_t v;
  std::memcpy(&v, q, sizeof(v));
  return v;
}

#if defined(__AVX2__)
// acc + per 32-bit lane the 4 products of the lane's code bytes and x's signed bytes: codes
// unsigned, or signed where SIGNED (without VNNI; with it signed codes come 128 higher, as
// unsigned: `prepared`). Without VNNI, pairs of products summed to int16 then to int32
// (vpmaddubsw, vpmaddwd): no pair of a 4- or 6-bit code's or a signed code's reaches 2^15.
template <bool SIGNED>
inline __m256i dot_quads(__m256i acc, __m256i codes, __m256i x) {
#if defined(SHARDLINE_VNNI) && defined(__AVX512VNNI__)
  return _mm256_dpbusd_epi32(acc, codes, x);
#elif defined(SHARDLINE_VNNI)
  return _mm256_dpbusd_avx_epi32(acc, codes, x);
#else
  const __m256i pairs = SIGNED ? _mm256_maddubs_epi16(_mm256_abs_epi8(codes), _mm256_sign_epi8(x, codes))
                               : _mm256_maddubs_epi16(codes, x);
  // The empty asm keeps each sum in its register, in order: integer adds being associative, GCC
  // otherwise regroups a group's products into a tree whose partial sums spill to the stack
  // (AVX2 has 16 vector registers): the 4-bit kernel ran 1.7x slower at 16 rows.
  __m256i sum = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  asm("" : "+x"(sum));
  return sum;
#endif
}

template <typename Codes>
inline __m256i prepared(__m256i codes) {
  return Codes::SIGNED && VNNI ? _mm256_xor_si256(codes, _mm256_set1_epi8(static_cast<char>(0x80))) : codes;
}

#if defined(SHARDLINE_WIDE)
template <bool SIGNED>
inline __m512i dot_quads(__m512i acc, __m512i codes, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, codes, x);
#else
  const __m512i signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(codes), _mm512_setzero_si512(), x);
  const __m512i pairs = SIGNED ? _mm512_maddubs_epi16(_mm512_abs_epi8(codes), signed_x) : _mm512_maddubs_epi16(codes, x);
  __m512i sum = _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
  asm("" : "+v"(sum));
  return sum;
#endif
}

template <typename Codes>
inline __m512i prepared(__m512i codes) {
  return Codes::SIGNED && VNNI ? _mm512_xor_si512(codes, _mm512_set1_epi8(static_cast<char>(0x80))) : codes;
}
#endif
#endif

// y[m, 8b + i] for the R activation rows from m0 and the NB blocks of 8 outputs from b0
// (constants, so that the sums stay in registers), block b0 being the thread's unit u0.
template <typename Codes, int NB, int R>
void dot_block(const char* records, const Int8Rows& xs, int64_t m0, int64_t b0, int64_t K, float* y, int64_t N,
               const Units& units, int64_t u0) {
  const int64_t groups = K / G;
  constexpr int OFFSET = offset<Codes>();
#if defined(__AVX2__)
  constexpr int LOADS = G / 4 / Codes::QUADS;
  constexpr bool SIGNED = Codes::SIGNED && !VNNI;
  const char* ahead[NB];  // the thread's blocks two runs on
  for (int b = 0; b < NB; ++b) ahead[b] = units.at<Codes>(u0 + 2 * NB + b);
  __m256 total[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) total[b][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const char* rec[NB];
    for (int b = 0; b < NB; ++b) rec[b] = record<Codes>(records, groups, b0 + b, g);
    // the records two runs of blocks ahead: decode's weights stream from memory, once per step
    // (the next layer's, at a layer's end). Into L2 only
    // (T2): two runs ahead is about 24 KB a thread at one row of SmolLM2's layers, most of a 32 KB
    // L1, and prefetched into L1 they were evicted before their use (forced AVX2, in-process A/B,
    // the 30 layers' 120 multiplies at one row: 4.55 -> 3.52 ms; the 8-bit LM head 1.50 -> 1.00).
    for (int b = 0; b < NB; ++b)
      for (int64_t line = 0; line < RECORD<Codes> + Codes::TAIL_BYTES; line += 64)
        _mm_prefetch(record<Codes>(ahead[b], groups, 0, g) + line, _MM_HINT_T2);
    const int8_t* xg = xs.q.data() + m0 * K + g * G;  // row m0 + r's group at xg + r K
    for (int h = 0; h < Codes::HALVES; ++h) {
      __m256i acc[NB][R];
      for (int r = 0; r < R; ++r) {
        const __m256i start =
            OFFSET ? _mm256_set1_epi32(-OFFSET * code_sum(xs, m0 + r, groups, g, h, Codes::HALVES)) : _mm256_setzero_si256();
        for (int b = 0; b < NB; ++b) acc[b][r] = start;
      }
#pragma GCC unroll 4  // 4- and 6-bit: the whole group; 8-bit: 4 of its 8 loads
      for (int l = h * LOADS / Codes::HALVES; l < (h + 1) * LOADS / Codes::HALVES; ++l) {
        typename Codes::Word w[NB];
        for (int b = 0; b < NB; ++b) w[b] = Codes::load(rec[b], l);
#pragma GCC unroll 2
        for (int s = 0; s < Codes::QUADS; ++s) {
          __m256i c[NB];
          for (int b = 0; b < NB; ++b) c[b] = prepared<Codes>(Codes::quads(w[b], l, s));
          for (int r = 0; r < R; ++r) {
            const __m256i x = _mm256_set1_epi32(quad_at(xg + r * K + 4 * (l * Codes::QUADS + s)));
            for (int b = 0; b < NB; ++b) acc[b][r] = dot_quads<SIGNED>(acc[b][r], c[b], x);
          }
        }
      }
      for (int b = 0; b < NB; ++b) {  // the sums scaled: 8 outputs at once
        const __m256 s = Codes::scale8(rec[b], g, h);
        for (int r = 0; r < R; ++r) {
          const float d = xs.d[(m0 + r) * groups + g];
          total[b][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[b][r]), _mm256_mul_ps(s, _mm256_set1_ps(d)), total[b][r]);
        }
      }
    }
    if constexpr (Codes::LO)
      for (int b = 0; b < NB; ++b) {  // the group's lo term
        const __m256 z = Codes::lo8(rec[b], g);
        for (int r = 0; r < R; ++r)
          total[b][r] = _mm256_fmadd_ps(z, _mm256_set1_ps(xs.lo_sum[(m0 + r) * groups + g]), total[b][r]);
      }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (m0 + r) * N + (b0 + b) * B, total[b][r]);
#else
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r)
      for (int64_t i = 0; i < B; ++i) {
        const int8_t* xq = xs.q.data() + (m0 + r) * K;
        float acc = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const char* rec = record<Codes>(records, groups, b0 + b, g);
          const int64_t row = (m0 + r) * groups + g;
          for (int h = 0; h < Codes::HALVES; ++h) {
            int32_t dot = 0;
            for (int64_t k = h * G / Codes::HALVES; k < (h + 1) * G / Codes::HALVES; ++k)
              dot += Codes::at(rec, i, k) * xq[g * G + lane_position(k)];
            acc += static_cast<float>(dot) * Codes::scale_at(rec, g, i, h) * xs.d[row];
          }
          if constexpr (Codes::LO) acc += Codes::lo_at(rec, g, i) * xs.lo_sum[row];
        }
        y[(m0 + r) * N + (b0 + b) * B + i] = acc;
      }
  (void)OFFSET;
#endif
}

#if defined(SHARDLINE_WIDE)
// dot_block for AVX-512: two blocks of 8 outputs in one 512-bit register (block b's in the low
// lanes, b + 1's in the high ones), so the records serve both widths, and a block pair's 16
// outputs are adjacent in y. Half the instructions per product of the 256-bit path, which at
// batch rows is bound by them (one row streams the weights from memory either way).
template <typename Codes, int NP, int R>  // NP pairs of blocks
void dot_block_pairs(const char* records, const Int8Rows& xs, int64_t m0, int64_t b0, int64_t K, float* y,
                     int64_t N, const Units& units, int64_t u0) {
  const int64_t groups = K / G;
  constexpr int LOADS = G / 4 / Codes::QUADS, OFFSET = offset<Codes>();
  constexpr bool SIGNED = Codes::SIGNED && !VNNI;
  const char* ahead[2 * NP];
  for (int b = 0; b < 2 * NP; ++b) ahead[b] = units.at<Codes>(u0 + 4 * NP + b);
  __m512 total[NP][R];
  for (int p = 0; p < NP; ++p)
    for (int r = 0; r < R; ++r) total[p][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const char* rec[2 * NP];
    for (int b = 0; b < 2 * NP; ++b) rec[b] = record<Codes>(records, groups, b0 + b, g);
    for (int b = 0; b < 2 * NP; ++b)  // two runs ahead, into L2, as dot_block says why
      for (int64_t line = 0; line < RECORD<Codes> + Codes::TAIL_BYTES; line += 64)
        _mm_prefetch(record<Codes>(ahead[b], groups, 0, g) + line, _MM_HINT_T2);
    const int8_t* xg = xs.q.data() + m0 * K + g * G;
    for (int h = 0; h < Codes::HALVES; ++h) {
      __m512i acc[NP][R];
      for (int r = 0; r < R; ++r) {
        const __m512i start =
            OFFSET ? _mm512_set1_epi32(-OFFSET * code_sum(xs, m0 + r, groups, g, h, Codes::HALVES)) : _mm512_setzero_si512();
        for (int p = 0; p < NP; ++p) acc[p][r] = start;
      }
#pragma GCC unroll 4
      for (int l = h * LOADS / Codes::HALVES; l < (h + 1) * LOADS / Codes::HALVES; ++l) {
        typename Codes::Wide w[NP];
        for (int p = 0; p < NP; ++p) w[p] = Codes::join(Codes::load(rec[2 * p], l), Codes::load(rec[2 * p + 1], l));
#pragma GCC unroll 2
        for (int s = 0; s < Codes::QUADS; ++s) {
          __m512i c[NP];
          for (int p = 0; p < NP; ++p) c[p] = prepared<Codes>(Codes::quads(w[p], l, s));
          for (int r = 0; r < R; ++r) {
            const __m512i x = _mm512_set1_epi32(quad_at(xg + r * K + 4 * (l * Codes::QUADS + s)));
            for (int p = 0; p < NP; ++p) acc[p][r] = dot_quads<SIGNED>(acc[p][r], c[p], x);
          }
        }
      }
      for (int p = 0; p < NP; ++p) {
        const __m512 s = join(Codes::scale8(rec[2 * p], g, h), Codes::scale8(rec[2 * p + 1], g, h));
        for (int r = 0; r < R; ++r) {
          const float d = xs.d[(m0 + r) * groups + g];
          total[p][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[p][r]), _mm512_mul_ps(s, _mm512_set1_ps(d)), total[p][r]);
        }
      }
    }
    if constexpr (Codes::LO)
      for (int p = 0; p < NP; ++p) {
        const __m512 z = join(Codes::lo8(rec[2 * p], g), Codes::lo8(rec[2 * p + 1], g));
        for (int r = 0; r < R; ++r)
          total[p][r] = _mm512_fmadd_ps(z, _mm512_set1_ps(xs.lo_sum[(m0 + r) * groups + g]), total[p][r]);
      }
  }
  for (int p = 0; p < NP; ++p)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (m0 + r) * N + (b0 + 2 * p) * B, total[p][r]);
}
#endif

// Blocks [b0, b1) in runs of NB (in pairs where the CPU has AVX-512), the last ones one at a time.
template <typename Codes, int NB, int R>
void dot_rows(const char* records, const Int8Rows& xs, int64_t m0, int64_t b0, int64_t b1, int64_t K, float* y,
              int64_t N, const Units& units, int64_t u0) {
  int64_t b = b0;
#if defined(SHARDLINE_WIDE)
  for (; b + NB <= b1; b += NB) dot_block_pairs<Codes, NB / 2, R>(records, xs, m0, b, K, y, N, units, u0 + b - b0);
#else
  for (; b + NB <= b1; b += NB) dot_block<Codes, NB, R>(records, xs, m0, b, K, y, N, units, u0 + b - b0);
#endif
  for (; b < b1; ++b) dot_block<Codes, 1, R>(records, xs, m0, b, K, y, N, units, u0 + b - b0);
}

// The records of a layer [N/8, K/32, RECORD] as a kernel takes them.
template <typename Codes>
void check_records(const at::Tensor& records, int64_t K) {
  TORCH_CHECK(records.scalar_type() == at::kByte && records.dim() == 3 && records.is_contiguous() &&
              K % (G * Codes::PER) == 0 && records.size(1) == K / G / Codes::PER && records.size(2) == STRIDE<Codes>,
              "the weights must be packed records [N/8, K/", G * Codes::PER, ", ", STRIDE<Codes>, "] uint8 for K = ", K);
}

// x [M, K] fp32 times the weights of several layers of one shape [N, K] (a mixture's experts),
// layer e on x's rows [offsets[e], offsets[e + 1]) into the same rows of y [M, N]; one layer is
// `offsets` {0, M}. One parallel region over all the layers' blocks, so that each thread streams
// weights from one layer into the next without a barrier between them (a decode step's experts,
// some 56 a layer of 2 rows each, read their weights a sixth slower one call each: AVX-512, 2
// threads). A block shape per activation rows left (1 to ROW_BLOCK), measured (AVX2, SmolLM2's
// layers): four blocks at one row, two at more; with AVX-512, four (two pairs) at every row count
// (a run of 5 to 8 rows costs less than a second run over the weights).
template <typename Codes>
at::Tensor multiply(at::TensorList records, const at::Tensor& x, at::IntArrayRef offsets) {
  using DotRows = void (*)(const char*, const Int8Rows&, int64_t, int64_t, int64_t, int64_t, float*, int64_t,
                           const Units&, int64_t);
#if defined(SHARDLINE_WIDE)
  constexpr int NB = 4;
  constexpr DotRows DOT_ROWS[ROW_BLOCK + 1] = {nullptr,
                                               dot_rows<Codes, 4, 1>, dot_rows<Codes, 4, 2>, dot_rows<Codes, 4, 3>,
                                               dot_rows<Codes, 4, 4>, dot_rows<Codes, 4, 5>, dot_rows<Codes, 4, 6>,
                                               dot_rows<Codes, 4, 7>, dot_rows<Codes, 4, 8>};
#else
  constexpr int NB = 2;
  constexpr DotRows DOT_ROWS[ROW_BLOCK + 1] = {nullptr, dot_rows<Codes, 4, 1>, dot_rows<Codes, NB, 2>,
                                               dot_rows<Codes, NB, 3>, dot_rows<Codes, NB, 4>};
#endif
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, K] float32");
  TORCH_CHECK(!records.empty() && offsets.size() == records.size() + 1, "one run of rows per layer");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = records[0].size(0) * B;
  TORCH_CHECK(offsets.front() == 0 && offsets.back() == M, "the layers' rows must be x's rows");
  std::vector<const char*> bases;  // the layers with rows, and their rows
  std::vector<int64_t> first, end;
  for (size_t e = 0; e < records.size(); ++e) {
    check_records<Codes>(records[e], K);
    TORCH_CHECK(records[e].size(0) * B == N && offsets[e] <= offsets[e + 1], "layers of one shape, rows in order");
    if (offsets[e] == offsets[e + 1]) continue;
    bases.push_back(reinterpret_cast<const char*>(records[e].const_data_ptr<uint8_t>()));
    first.push_back(offsets[e]), end.push_back(offsets[e + 1]);
  }
  if (M == 0) return at::empty({0, N}, x.options());
  const Int8Rows rows = int8_activations(xc.const_data_ptr<float>(), M, K);
  at::Tensor y = at::empty({M, N}, x.options());
  float* out = y.data_ptr<float>();
  const int64_t blocks = N / B, block_bytes = K / G / Codes::PER * STRIDE<Codes>;
  // Blocks a chunk, whole runs: at most CHUNK_BYTES, and few enough that every thread gets several
  // (a small model's 576x576 layer is one chunk of CHUNK_BYTES; one thread would do all of it).
  const int64_t runs = static_cast<int64_t>(bases.size()) * blocks / NB;
  const int64_t chunk = std::max<int64_t>(1, std::min(CHUNK_BYTES / (block_bytes * NB),
                                                      runs / (CHUNKS_PER_THREAD * at::get_num_threads()))) * NB;
  // The work is handed out a chunk at a time to whichever thread asks next, each chunk with all
  // of its layer's rows (whose runs read its weights from L2): split in equal parts, a thread
  // that another process preempts (on 2 cores, the router's own, or a neighbour's) holds up the
  // whole step with its part, while the other waits.
  std::vector<int64_t> starts;  // each chunk's first unit; a chunk ends at the next's or its layer's end
  for (size_t e = 0; e < bases.size(); ++e)
    for (int64_t b = 0; b < blocks; b += chunk) starts.push_back(static_cast<int64_t>(e) * blocks + b);
  const int64_t chunks = static_cast<int64_t>(starts.size());
  const auto chunk_end = [&](int64_t c) { return std::min(starts[c] / blocks * blocks + blocks, starts[c] + chunk); };
  std::atomic<int64_t> claimed{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), chunks), 1, [&](int64_t, int64_t) {
    for (int64_t c = claimed.fetch_add(1), next = claimed.fetch_add(1); c < chunks; c = next, next = claimed.fetch_add(1)) {
      const int64_t u = starts[c], e = u / blocks, b0 = u % blocks, b1 = chunk_end(c) - e * blocks;
      const Units units{bases, blocks, K / G, chunk_end(c), next < chunks ? starts[next] : 0, next < chunks ? chunk_end(next) : 0};
      for (int64_t m0 = first[e]; m0 < end[e]; m0 += ROW_BLOCK)
        DOT_ROWS[std::min(ROW_BLOCK, end[e] - m0)](bases[e], rows, m0, b0, b1, K, out, N, units, u);
    }
  });
  return y;
}

#if defined(__AVX2__)
// 8 floats stored as 8 bf16, rounded to nearest even (NaNs aside: weights and activations have none).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(v)));
#else
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
#endif
}
#endif

// Output rows [8 b0, 8 b1) of the weights, transposed, into wt [K, ld] (fp32 or bf16): a block's 8
// outputs are 8 adjacent columns, so each quad of codes unpacks to four rows of 8 values.
template <typename Codes, typename T>
void dequantize(const char* records, int64_t K, int64_t b0, int64_t b1, T* wt, int64_t ld) {
  const int64_t groups = K / G;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = b0; b < b1; ++b) {
        const char* rec = record<Codes>(records, groups, b, g);
        T* out = wt + g * G * ld + (b - b0) * B;
#if defined(__AVX2__)
        constexpr int LOADS = G / 4 / Codes::QUADS;
        const __m256 z = Codes::LO ? Codes::lo8(rec, g) : _mm256_setzero_ps();
        for (int l = 0; l < LOADS; ++l) {
          const typename Codes::Word w = Codes::load(rec, l);
          const __m256 s = Codes::scale8(rec, g, l * Codes::HALVES / LOADS);
          const __m256 origin = _mm256_fnmadd_ps(_mm256_set1_ps(static_cast<float>(Codes::OFFSET)), s, z);
#pragma GCC unroll 2
          for (int q = 0; q < Codes::QUADS; ++q) {  // per lane, the byte codes of 4 weights in lane order
            const __m256i c = Codes::quads(w, l, q);
            const int64_t first = 4 * (l * Codes::QUADS + q);
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
              const __m256i code = Codes::SIGNED ? _mm256_srai_epi32(_mm256_slli_epi32(c, 24 - 8 * j), 24)
                                                 : _mm256_and_si256(_mm256_srli_epi32(c, 8 * j), _mm256_set1_epi32(0xFF));
              store8(out + weight_at(first + j) * ld, _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), s, origin));
            }
          }
        }
#else
        for (int64_t k = 0; k < G; ++k)
          for (int64_t i = 0; i < B; ++i)
            out[k * ld + i] = (Codes::LO ? Codes::lo_at(rec, g, i) : 0.f) +
                              Codes::scale_at(rec, g, i, k * Codes::HALVES / G) * static_cast<float>(Codes::at(rec, i, k));
#endif
      }
  });
}

// x [M, K] fp32 times the weights that `records` hold, through torch's GEMM on slices of about
// a MB of weights dequantized at a time (no dense copy is kept) -> [M, N] fp32.
template <typename Codes>
at::Tensor through_gemm(const at::Tensor& x, const at::Tensor& records, bool bf16) {
  constexpr int64_t SLICE_BYTES = 1 << 20;
  const int64_t M = x.size(0), K = x.size(1), N = records.size(0) * B, size = bf16 ? 2 : 4;
  const char* base = reinterpret_cast<const char*>(records.const_data_ptr<uint8_t>());
  const int64_t slice = std::max<int64_t>(2, SLICE_BYTES / (size * K * B)) * B;  // outputs, whole blocks
  const at::Tensor xs = bf16 ? x.to(at::kBFloat16) : x;
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor wt = at::empty({K, std::min(slice, N)}, xs.options());
  for (int64_t n0 = 0; n0 < N; n0 += slice) {
    const int64_t n1 = std::min(N, n0 + slice);
    if (bf16)
      dequantize<Codes>(base, K, n0 / B, n1 / B, wt.data_ptr<c10::BFloat16>(), wt.size(1));
    else
      dequantize<Codes>(base, K, n0 / B, n1 / B, wt.data_ptr<float>(), wt.size(1));
    y.slice(1, n0, n1).copy_(at::mm(xs, wt.slice(1, 0, n1 - n0)));
  }
  return y;
}

// x [M, K] fp32 times the weights that `records` hold -> [M, N] fp32: up to `max_direct_rows`
// rows straight from the codes, more through the GEMM (in bf16 where `bf16_gemm`).
template <typename Codes>
at::Tensor linear(const at::Tensor& x, const at::Tensor& records, int64_t max_direct_rows, bool bf16_gemm) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, K] float32");
  if (x.size(0) <= max_direct_rows) return multiply<Codes>(records, x, {0, x.size(0)});
  check_records<Codes>(records, x.size(1));
  return through_gemm<Codes>(x.contiguous(), records, bf16_gemm);
}

// The weight rows `tokens` [T] of the layer that `records` hold, fp32 [T, K] (a tied embedding's
// lookups): each token's block's records, and in them its lane.
template <typename Codes>
at::Tensor weight_rows(const at::Tensor& records, const at::Tensor& tokens) {
  check_records<Codes>(records, records.size(1) * Codes::PER * G);
  const at::Tensor t = tokens.to(at::kLong).contiguous();
  const int64_t T = t.numel(), groups = records.size(1) * Codes::PER, N = records.size(0) * B;
  const int64_t* tp = t.const_data_ptr<int64_t>();
  for (int64_t j = 0; j < T; ++j) TORCH_CHECK(tp[j] >= 0 && tp[j] < N, "row ", tp[j], " is not one of ", N);
  const char* base = reinterpret_cast<const char*>(records.const_data_ptr<uint8_t>());
  at::Tensor out = at::empty({T, groups * G}, records.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t g = 0; g < groups; ++g) {
        const char* rec = record<Codes>(base, groups, tp[j] / B, g);
        const int64_t i = tp[j] % B;
        for (int64_t k = 0; k < G; ++k)
          op[j * groups * G + g * G + k] = (Codes::LO ? Codes::lo_at(rec, g, i) : 0.f) +
                                           Codes::scale_at(rec, g, i, k * Codes::HALVES / G) * static_cast<float>(Codes::at(rec, i, k));
      }
  });
  return out;
}

}  // namespace shardline::interleaved
