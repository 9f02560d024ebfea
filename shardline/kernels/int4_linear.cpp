// Shardline's 4-bit linear kernel (shardline_native::int4_linear).
//
// Weights are groups of 32 along the input dimension, w = lo + scale * code with codes 0..15
// (GGUF's Q4_0, Q4_1 and Q4_K blocks are such groups: kernels/grid.py), held 4 bits each with
// eight output rows interleaved across the vector lanes, in records (interleaved.h): for each
// block of 8 outputs and each group, 4 loads of 8 int32 words, the word of lane i in load l
// holding in its bits 4q..4q+3 the code of output 8b + i for weight 2p and in bits 16+4q.. that
// for weight 2p + 1 (p = 4l + q, the weights counted within the group). So word & 0x0F0F0F0F is,
// per lane, the byte codes of one output for weights 0, 4, 1 and 5 of the load's 8, and
// (word >> 4) & 0x0F0F0F0F those for 2, 6, 3 and 7: the activations' lane order, which one
// broadcast of 4 activations serves for all 8 outputs; and a group's scales and los are one load
// per 8 outputs. (Laid out per output instead, each output's lanes held partial sums, and every
// group cost per output and row a conversion, an FMA and a broadcast of its scale: 1.6-1.7x
// slower at 1 to 32 rows, AVX2.)
//
// Decode's rows (`rows <= max_direct_rows`) are multiplied straight from the codes, with the
// activations quantized to int8 per group of 32 (`int8_activations`: x ~= dx * xq, |xq| <= 127):
// each lane's 4 codes times 4 activations is one integer multiply-add (VNNI's vpdpbusd; AVX2's
// vpmaddubsw and vpmaddwd), exact, and a group's sums for 8 outputs are converted and scaled
// once, the group's lo term (lo times dx times the sum of the group's xq, so that the term is of
// the same rounded activations) one more FMA.
//
// More rows (prefill, long chunks) go through a GEMM on slices dequantized on the fly
// (interleaved.h, `through_gemm`): the unpacking is paid once per slice for all rows, and no dense
// copy is kept. (An int8 GEMM there, activations per row and weights requantized per output row,
// was 1.7x faster at 512 rows on AVX2 and cost SmolLM2 its quality gate: same top-1 90.5%.)

#include "interleaved.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <vector>

namespace {

using shardline::interleaved::B;
using shardline::interleaved::G;
constexpr int64_t WORDS = 4 * B;          // int32 words of a record's codes: 4 loads of 8 lanes

// A record's codes, as the shared direct path reads them (interleaved.h).
struct Int4Codes : shardline::interleaved::GroupScales<WORDS * 4> {
  static const uint32_t* words(const char* rec) { return reinterpret_cast<const uint32_t*>(rec); }

  static constexpr int OFFSET = 0;
  static constexpr bool SIGNED = false;
#if defined(__AVX2__)
  static constexpr int QUADS = 2;  // a load is 8 words of 8 codes: the low nibbles of its bytes, then the high
  static __m256i load(const char* rec, int l) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words(rec) + l * B));
  }
  static __m256i quads(__m256i w, int, int s) {
    return _mm256_and_si256(s == 0 ? w : _mm256_srli_epi32(w, 4), _mm256_set1_epi8(0x0F));
  }
#if defined(SHARDLINE_WIDE)
  static __m512i quads(__m512i w, int, int s) {
    return _mm512_and_si512(s == 0 ? w : _mm512_srli_epi32(w, 4), _mm512_set1_epi8(0x0F));
  }
#endif
#endif
  // the word of the record's codes, and the bit in it, where output i's code for weight k of the
  // group begins (the layout above)
  static int64_t word(int64_t i, int64_t k) { return k / 8 * B + i; }
  static int shift(int64_t k) { return 4 * (k / 2 % 4) + 16 * (k % 2); }
  static int32_t at(const char* rec, int64_t i, int64_t k) {  // for the scalar paths
    return static_cast<int32_t>((words(rec)[word(i, k)] >> shift(k)) & 0xF);
  }
};


// Q4_K's blocks as they are (`q4_k_pack`): the codes of a group as Int4Codes holds them, then the
// 8 outputs' 6-bit scales sc and mins m (a byte each), and after a super-block's 8 groups the 8
// outputs' fp16 d and dmin: scale d * sc and lo -dmin * m, computed in fp32, exactly. 1184 bytes
// for 8 x 256 weights, 4.625 bits a weight (4-bit records with fp16 scales and los: 5, and
// Q4_K's products of two scales rounded to fp16).
struct Q4KCodes : Int4Codes {
  static constexpr int64_t SCALE_BYTES = 2 * B;
  static constexpr int64_t PER = 8, TAIL_BYTES = 2 * B * sizeof(c10::Half);
  static const uint8_t* sc(const char* rec) { return reinterpret_cast<const uint8_t*>(rec + CODE_BYTES); }
  static const uint8_t* m(const char* rec) { return sc(rec) + B; }
  // the super-block's d (8), then its dmin (8), after its 8 groups' records
  static const c10::Half* tail(const char* rec, int64_t g) {
    return reinterpret_cast<const c10::Half*>(rec + (PER - g % PER) * (CODE_BYTES + SCALE_BYTES));
  }
  static float scale_at(const char* rec, int64_t g, int64_t i, int) {
    return static_cast<float>(tail(rec, g)[i]) * static_cast<float>(sc(rec)[i]);
  }
  static float lo_at(const char* rec, int64_t g, int64_t i) {
    return -(static_cast<float>(tail(rec, g)[B + i]) * static_cast<float>(m(rec)[i]));
  }
#if defined(__AVX2__)
  static __m256 bytes8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static __m256 scale8(const char* rec, int64_t g, int) {
    return _mm256_mul_ps(shardline::load_half8(tail(rec, g)), bytes8(sc(rec)));
  }
  static __m256 lo8(const char* rec, int64_t g) {
    return _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(shardline::load_half8(tail(rec, g) + B), bytes8(m(rec))));
  }
#endif
};
}  // namespace

namespace shardline {

Int8Rows int8_activations(const float* x, int64_t M, int64_t K) {
  const int64_t groups = K / G;
  Int8Rows rows{std::vector<int8_t>(M * K), std::vector<float>(M * groups), std::vector<float>(M * groups),
                std::vector<int32_t>(M * groups * 2)};
  at::parallel_for(0, M * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // group i of the rows, as x is laid out
      const float* xg = x + i * G;
      int8_t* q = rows.q.data() + i * G;
      int32_t* halves = rows.sum16.data() + 2 * i;
#if defined(__AVX2__)
      const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      __m256 v[4], amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(xg + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], magnitude));
      }
      const float top = shardline::hmax(amax);
      const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
      __m256i c[4];  // rounded to nearest
      for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
      for (int h = 0; h < 2; ++h)
        halves[h] = static_cast<int32_t>(shardline::hsum(_mm256_cvtepi32_ps(_mm256_add_epi32(c[2 * h], c[2 * h + 1]))));
      // packs interleave the 128-bit halves (the permute undoes it), then each 8 into lane order
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
      const __m256i natural = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      const __m256i order = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
                                             0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_shuffle_epi8(natural, order));
#else
      float top = 0.f;
      for (int j = 0; j < G; ++j) top = std::max(top, std::fabs(xg[j]));
      const float inv = top > 0.f ? 127.f / top : 0.f;
      halves[0] = halves[1] = 0;
      for (int j = 0; j < G; ++j) {
        const int8_t c = static_cast<int8_t>(std::nearbyint(xg[j] * inv));
        q[interleaved::lane_position(j)] = c;
        halves[j / 16] += c;
      }
#endif
      rows.d[i] = top / 127.f;
      rows.lo_sum[i] = rows.d[i] * static_cast<float>(halves[0] + halves[1]);
    }
  });
  return rows;
}


namespace {

float half_at(const uint8_t* p) { return static_cast<float>(c10::Half(static_cast<uint16_t>(p[0] | p[1] << 8), c10::Half::from_bits())); }

}  // namespace

at::Tensor int4_pack(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& lo) {
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) % G == 0 && codes.size(0) % B == 0,
              "codes must be [N, K] with N a multiple of ", B, " and K of ", G);
  const at::Tensor c = codes.to(at::kInt).contiguous();
  const int64_t K = c.size(1);
  const int32_t* src = c.const_data_ptr<int32_t>();
  return interleaved::pack<Int4Codes>(scale, lo, c.size(0), K, [&](char* rec, int64_t b, int64_t g) {
    interleaved::RecordCodes codes;
    for (int64_t i = 0; i < B; ++i)
      for (int64_t k = 0; k < G; ++k) codes[i][k] = static_cast<uint8_t>(src[(b * B + i) * K + g * G + k]);
    interleaved::write_nibbles(rec, codes);
  });
}

// GGUF's Q4_K blocks, 144 bytes per 256 weights: fp16 d and dmin, 12 bytes of 6-bit scales and
// mins (kernels/gguf_groups.py says how they are packed), and 128 bytes of codes, whose 32-byte
// chunk c holds sub-block 2c in its low nibbles and 2c + 1 in its high ones; into Q4KCodes'
// records, which hold them as they are.
at::Tensor q4_k_pack(const at::Tensor& blocks) {
  constexpr int64_t BLOCK = 144;
  const interleaved::BlockRows rows = interleaved::block_rows(blocks, BLOCK, "Q4_K");
  const int64_t N = rows.N;
  return interleaved::pack<Q4KCodes>(blocks.options(), (N + B - 1) / B * B, rows.K, [&](char* rec, int64_t b, int64_t g) {
    uint8_t* sc = reinterpret_cast<uint8_t*>(rec + Q4KCodes::CODE_BYTES);
    c10::Half* tail = const_cast<c10::Half*>(Q4KCodes::tail(rec, g));
    interleaved::RecordCodes codes = {};
    const int j = g % 8, shift = 4 * (j % 2);
    for (int64_t i = 0; i < B; ++i) {
      sc[i] = sc[B + i] = 0;
      if (j == 0) tail[i] = tail[B + i] = 0.f;
      if (b * B + i >= N) continue;  // a padded block's rows: zero weights
      const uint8_t* block = rows.block(b * B + i, g, BLOCK);
      const uint8_t* s = block + 4;
      sc[i] = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 2) & 0x30);
      sc[B + i] = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
      if (j == 0) std::memcpy(tail + i, block, 2), std::memcpy(tail + B + i, block + 2, 2);
      const uint8_t* qs = block + 16 + 32 * (j / 2);
      for (int64_t k = 0; k < G; ++k) codes[i][k] = static_cast<uint8_t>(qs[k] >> shift);
    }
    interleaved::write_nibbles(rec, codes);
  });
}

namespace {

template <typename Codes>
std::tuple<at::Tensor, at::Tensor, at::Tensor> groups_of(const at::Tensor& records) {
  const int64_t N = records.size(0) * B, groups = records.size(1) * Codes::PER, K = groups * G;
  interleaved::check_records<Codes>(records, K);
  at::Tensor codes = at::empty({N, K}, records.options()), scale = at::empty({N, groups}, records.options().dtype(at::kFloat));
  at::Tensor lo = at::empty({N, groups}, scale.options());
  const char* base = reinterpret_cast<const char*>(records.const_data_ptr<uint8_t>());
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float *sp = scale.data_ptr<float>(), *lp = lo.data_ptr<float>();
  at::parallel_for(0, N / B, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t g = 0; g < groups; ++g) {
        const char* rec = interleaved::record<Codes>(base, groups, b, g);
        for (int64_t i = 0; i < B; ++i) {
          const int64_t row = b * B + i;
          for (int64_t k = 0; k < G; ++k) cp[row * K + g * G + k] = static_cast<uint8_t>(Codes::at(rec, i, k));
          sp[row * groups + g] = Codes::scale_at(rec, g, i, 0), lp[row * groups + g] = Codes::lo_at(rec, g, i);
        }
      }
  });
  return {codes, scale, lo};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_groups(const at::Tensor& records) {
  TORCH_CHECK(records.dim() == 3, "records must be [N/8, groups, bytes]");
  if (records.size(2) == interleaved::STRIDE<Q4KCodes>) return groups_of<Q4KCodes>(records);
  return groups_of<Int4Codes>(records);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& records, int64_t max_direct_rows, bool bf16_gemm) {
  return interleaved::linear<Int4Codes>(x, records, max_direct_rows, bf16_gemm);
}

at::Tensor q4_k_linear(const at::Tensor& x, const at::Tensor& records, int64_t max_direct_rows, bool bf16_gemm) {
  return interleaved::linear<Q4KCodes>(x, records, max_direct_rows, bf16_gemm);
}

at::Tensor int4_linears(const at::Tensor& x, at::TensorList records, at::IntArrayRef offsets) {
  return interleaved::multiply<Int4Codes>(records, x, offsets);
}

at::Tensor q4_k_linears(const at::Tensor& x, at::TensorList records, at::IntArrayRef offsets) {
  return interleaved::multiply<Q4KCodes>(records, x, offsets);
}

at::Tensor int4_rows(const at::Tensor& records, const at::Tensor& tokens) {
  if (records.dim() == 3 && records.size(2) == interleaved::STRIDE<Q4KCodes>)
    return interleaved::weight_rows<Q4KCodes>(records, tokens);
  return interleaved::weight_rows<Int4Codes>(records, tokens);
}

}  // namespace shardline
