// Shardline's 6-bit linear kernel (shardline_native::int6_linear): GGUF's Q6_K layers, at their own
// width and exactly.
//
// A Q6_K super-block of 256 weights holds each weight as a 6-bit code q, an int8 scale sc per 16
// weights and one fp16 d: w = d * sc * (q - 32). Here a record is one block of 8 outputs and group
// of 32 weights, read by the direct path and the GEMM that the 4- and 8-bit kernels share
// (interleaved.h), laid out as:
//   128 bytes  the codes' low 4 bits, as int4_linear.cpp holds its codes (4 loads of 8 words);
//    64 bytes  their high 2 bits, 32 bytes per half group h, 4 for each output i: the high bits of
//              its quads (interleaved.h) 4h .. 4h + 3, quad 4h + j at bits 4 + 2j of each byte (j
//              < 2) or 2j - 4, so that a shift and an AND put them beside the low bits' quad;
//    16 bytes  the int8 scales: the 8 outputs' of weights 0-15, then of weights 16-31;
//    16 bytes  the 8 outputs' fp16 d (their super-block's).
// 224 bytes for 256 weights, 7 bits a weight (Q6_K's own: 6.56; as int8 groups: 9, and rounded,
// since a group's two scales put its weights on no grid of 255 levels).
//
// A quad unpacks in four instructions to unsigned codes q; each half of a group is summed apart,
// from minus 32 times its activations' sum (OFFSET), and scaled by d * sc, which fp32 holds
// exactly (11 bits times 8): the weights are the file's. No lo.

#include "interleaved.h"

#include <algorithm>
#include <cstdint>

namespace {

using shardline::interleaved::B;
using shardline::interleaved::G;

struct Int6Codes {
  static constexpr int64_t CODE_BYTES = 6 * G * B / 8;
  static constexpr int64_t SCALE_BYTES = 2 * B + B * sizeof(c10::Half);
  static constexpr int HALVES = 2;
  static constexpr bool LO = false, SIGNED = false;
  static constexpr int OFFSET = 32;
  static constexpr int64_t PER = 1, TAIL_BYTES = 0;

  static const uint32_t* low(const char* rec) { return reinterpret_cast<const uint32_t*>(rec); }
  static const uint8_t* high(const char* rec) { return reinterpret_cast<const uint8_t*>(rec) + 4 * G * B / 8; }
  static const int8_t* sc(const char* rec) { return reinterpret_cast<const int8_t*>(rec + CODE_BYTES); }
  static const c10::Half* d(const char* rec) { return reinterpret_cast<const c10::Half*>(rec + CODE_BYTES + 2 * B); }

  // where output i's code for weight k of the group lies: its low bits (the word, and the bit in
  // it) as int4's, its high bits (the byte, and the bit in it) by the weight's lane position p:
  // quad p / 4 of the group, byte p % 4 of the output's word
  static int64_t word(int64_t i, int64_t k) { return k / 8 * B + i; }
  static int shift(int64_t k) { return 4 * (k / 2 % 4) + 16 * (k % 2); }
  static int64_t high_byte(int64_t i, int64_t k) {
    const int64_t p = shardline::interleaved::lane_position(k);
    return p / 16 * 4 * B + 4 * i + p % 4;
  }
  static int high_shift(int64_t k) {
    const int64_t j = shardline::interleaved::lane_position(k) % 16 / 4;
    return j < 2 ? 4 + 2 * j : 2 * j - 4;
  }
  static int32_t at(const char* rec, int64_t i, int64_t k) {
    const uint32_t low_bits = (low(rec)[word(i, k)] >> shift(k)) & 0xF;
    const uint32_t high_bits = (high(rec)[high_byte(i, k)] >> high_shift(k)) & 0x3;
    return static_cast<int32_t>(low_bits | high_bits << 4) - OFFSET;
  }
  static float scale_at(const char* rec, int64_t, int64_t i, int h) {
    return static_cast<float>(d(rec)[i]) * static_cast<float>(sc(rec)[h * B + i]);
  }
  static float lo_at(const char*, int64_t, int64_t) { return 0.f; }

#if defined(__AVX2__)
  static constexpr int QUADS = 2;  // as int4's: a load is 8 words of 8 low nibbles, and their half's high bits
  struct Word {
    __m256i low, high;
  };
  static Word load(const char* rec, int l) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low(rec) + l * B)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high(rec) + l / 2 * 4 * B))};
  }
  // Quad 2l + s: the low nibbles' quad, and its high bits moved from 4 + 2j or 2j - 4 to 4 (j = 2
  // (l % 2) + s; what a shift moves across bytes is masked).
  static __m256i quads(const Word& w, int l, int s) {
    const __m256i low_bits = _mm256_and_si256(s == 0 ? w.low : _mm256_srli_epi32(w.low, 4), _mm256_set1_epi8(0x0F));
    const int j = 2 * (l % 2) + s;
    const __m256i moved = j == 0 ? w.high : j == 1 ? _mm256_srli_epi32(w.high, 2) : _mm256_slli_epi32(w.high, 8 - 2 * j);
    return _mm256_or_si256(low_bits, _mm256_and_si256(moved, _mm256_set1_epi8(0x30)));
  }
  static __m256 scale8(const char* rec, int64_t, int h) {
    const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc(rec) + h * B));
    return _mm256_mul_ps(shardline::load_half8(d(rec)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)));
  }
  static __m256 lo8(const char*, int64_t) { return _mm256_setzero_ps(); }
#if defined(SHARDLINE_WIDE)
  struct Wide {
    __m512i low, high;
  };
  static Wide join(const Word& a, const Word& b) {
    return {shardline::interleaved::join(a.low, b.low), shardline::interleaved::join(a.high, b.high)};
  }
  static __m512i quads(const Wide& w, int l, int s) {
    const __m512i low_bits = _mm512_and_si512(s == 0 ? w.low : _mm512_srli_epi32(w.low, 4), _mm512_set1_epi8(0x0F));
    const int j = 2 * (l % 2) + s;
    const __m512i moved = j == 0 ? w.high : j == 1 ? _mm512_srli_epi32(w.high, 2) : _mm512_slli_epi32(w.high, 8 - 2 * j);
    return _mm512_or_si512(low_bits, _mm512_and_si512(moved, _mm512_set1_epi8(0x30)));
  }
#endif
#endif
};

}  // namespace

namespace shardline {

namespace {

// Record (b, g) of a layer of N rows: codes[i][k] is output 8b + i's code (0..63) for weight k of
// the group (zero for rows from N on: padding), sc(i, h) its int8 scale of half h, d(i) its d.
template <typename Scale, typename D>
void write_record(char* rec, int64_t b, int64_t N, const interleaved::RecordCodes& codes, Scale sc, D d) {
  std::fill(rec, rec + interleaved::RECORD<Int6Codes>, 0);
  interleaved::write_nibbles(rec, codes);
  uint8_t* high = reinterpret_cast<uint8_t*>(rec) + 4 * G * B / 8;
  int8_t* scales = reinterpret_cast<int8_t*>(rec + Int6Codes::CODE_BYTES);
  c10::Half* ds = reinterpret_cast<c10::Half*>(rec + Int6Codes::CODE_BYTES + 2 * B);
  for (int64_t i = 0; i < B && b * B + i < N; ++i) {
    // byte p % 4 of output i's word for quads 4h .. 4h + 3 holds the high bits of lane positions
    // p = 16h + 4j + p % 4, quad j's at bit 4 + 2j (j < 2) or 2j - 4 (Int6Codes' layout)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t r = 0; r < 4; ++r) {
        uint32_t byte = 0;
        for (int j = 0; j < 4; ++j)
          byte |= (codes[i][interleaved::weight_at(16 * h + 4 * j + r)] >> 4 & 0x3u) << (j < 2 ? 4 + 2 * j : 2 * j - 4);
        high[h * 4 * B + 4 * i + r] = static_cast<uint8_t>(byte);
      }
    for (int h = 0; h < 2; ++h) scales[h * B + i] = sc(i, h);
    ds[i] = d(i);
  }
}

}  // namespace

at::Tensor int6_pack(const at::Tensor& codes, const at::Tensor& sc, const at::Tensor& d) {
  TORCH_CHECK(codes.dim() == 2 && codes.size(0) % B == 0 && codes.size(1) % G == 0,
              "codes must be [N, K] with N a multiple of ", B, " and K of ", G);
  const int64_t N = codes.size(0), K = codes.size(1), groups = K / G;
  TORCH_CHECK(sc.dim() == 2 && sc.size(0) == N && sc.size(1) == 2 * groups && sc.scalar_type() == at::kChar,
              "sc must be [N, K/16] int8");
  TORCH_CHECK(d.dim() == 2 && d.size(0) == N && d.size(1) == groups, "d must be [N, K/32]");
  const at::Tensor c = codes.to(at::kByte).contiguous(), s = sc.contiguous(), dh = d.to(at::kHalf).contiguous();
  const uint8_t* cp = c.const_data_ptr<uint8_t>();
  const int8_t* sp = s.const_data_ptr<int8_t>();
  const c10::Half* dp = dh.const_data_ptr<c10::Half>();
  return interleaved::pack<Int6Codes>(codes.options(), N, K, [&](char* rec, int64_t b, int64_t g) {
    interleaved::RecordCodes group;
    for (int64_t i = 0; i < B; ++i)
      for (int64_t k = 0; k < G; ++k) group[i][k] = cp[(b * B + i) * K + g * G + k] & 0x3F;
    write_record(
        rec, b, N, group,
        [&](int64_t i, int h) { return sp[(b * B + i) * 2 * groups + 2 * g + h]; },
        [&](int64_t i) { return dp[(b * B + i) * groups + g]; });
  });
}

// GGUF's Q6_K blocks, 210 bytes per 256 weights: 128 bytes of low nibbles, 64 of high bit pairs,
// 16 int8 scales and an fp16 d. Each half of 128 weights takes 64 low-nibble bytes (their low
// nibbles are its weights 0-63, their high ones 64-127) and 32 high bytes (bits 2j of byte l are
// its weight 32j + l's).
at::Tensor q6_k_pack(const at::Tensor& blocks) {
  constexpr int64_t BLOCK = 210;
  const interleaved::BlockRows rows = interleaved::block_rows(blocks, BLOCK, "Q6_K");
  const int64_t N = rows.N;
  return interleaved::pack<Int6Codes>(blocks.options(), (N + B - 1) / B * B, rows.K, [&](char* rec, int64_t b, int64_t g) {
    const auto block = [&](int64_t i) { return rows.block(b * B + i, g, BLOCK); };
    // the group's 32 weights t = 32 (g % 8) + k of its block lie in half t / 128, at u = t % 128:
    // low nibbles in bytes u % 64 (high nibbles from u = 64 on), high bit pairs in bytes u % 32
    const int64_t half = g % 8 / 4, u = g % 4 * G;
    interleaved::RecordCodes codes = {};
    for (int64_t i = 0; i < B && b * B + i < N; ++i) {
      const uint8_t* low = block(i) + 64 * half + u % 64;
      const uint8_t* high = block(i) + 128 + 32 * half;
      const int low_shift = 4 * (u / 64), high_shift = 2 * (u / 32);
      for (int64_t k = 0; k < G; ++k)
        codes[i][k] = static_cast<uint8_t>((low[k] >> low_shift & 0xF) | (high[k] >> high_shift & 0x3) << 4);
    }
    write_record(
        rec, b, N, codes,
        [&](int64_t i, int h) { return static_cast<int8_t>(block(i)[192 + 2 * (g % 8) + h]); },
        [&](int64_t i) {
          const uint8_t* p = block(i) + 208;
          return c10::Half(static_cast<uint16_t>(p[0] | p[1] << 8), c10::Half::from_bits());
        });
  });
}

at::Tensor int6_linear(const at::Tensor& x, const at::Tensor& records, int64_t max_direct_rows, bool bf16_gemm) {
  return interleaved::linear<Int6Codes>(x, records, max_direct_rows, bf16_gemm);
}

at::Tensor int6_linears(const at::Tensor& x, at::TensorList records, at::IntArrayRef offsets) {
  return interleaved::multiply<Int6Codes>(records, x, offsets);
}

at::Tensor int6_rows(const at::Tensor& records, const at::Tensor& tokens) {
  return interleaved::weight_rows<Int6Codes>(records, tokens);
}

}  // namespace shardline
