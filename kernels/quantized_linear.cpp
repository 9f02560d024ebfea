// Shardline's quantized linear kernel (shardline_native::quantized_linear).
//
// Weights are held in groups of 32 along the input dimension, w = lo + scale * code:
//   4-bit: codes 0..15, 16 bytes per group; byte j holds code j (low nibble) and code j+16.
//          scale and lo in fp16, which GGUF's Q4_0 and Q4_1 blocks store: those stay exact.
//   8-bit: codes as int8 -128..127 (lo includes the +128 shift); scale and lo in fp32, since a
//          Q8_0 block's shifted lo needs more bits than fp16 has.
// Activations are quantized to int8 per group of 32 (x ~= dx * xq), as llama.cpp does, so each
// group's dot product is an integer one (AVX2 maddubs, or AVX-512 VNNI dpbusd where the compiler
// targets it): y = sum_g scale * dx * dot(code, xq) + lo * dx * sum(xq).

#include "native.h"

#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t G = 32;
constexpr int64_t ROW_TILE = 4;  // activation rows multiplied against one unpacked weight group

struct QuantizedRows {
  std::vector<int8_t> q;   // [M, K]
  std::vector<float> d;    // [M, K/32] scale of each group
  std::vector<float> s;    // [M, K/32] d * sum(q) of each group
};

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t groups = K / G;
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * groups), std::vector<float>(M * groups)};
  at::parallel_for(0, M * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xg = x + i * G;
      float amax = 0.f;
      for (int j = 0; j < G; ++j) amax = std::max(amax, std::fabs(xg[j]));
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int sum = 0;
      for (int j = 0; j < G; ++j) {
        const int v = static_cast<int>(std::nearbyint(xg[j] * inv));
        r.q[i * G + j] = static_cast<int8_t>(v);
        sum += v;
      }
      r.d[i] = d;
      r.s[i] = d * static_cast<float>(sum);
    }
  });
  return r;
}

#if defined(__AVX2__)
// 8 partial int32 sums of a 32-byte group: unsigned codes times signed activations.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else  // exact while u * s pair sums fit int16: codes up to 128 against |s| <= 127
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline __m256i unpack4(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

#endif

// y[r, n] for rows [r0, r0 + tile) and outputs [n0, n1).
template <int BITS, typename S>
void gemm_tile(const QuantizedRows& xq, int64_t r0, int64_t tile, int64_t K, const uint8_t* codes,
               const S* scale, const S* lo, int64_t n0, int64_t n1, int64_t N, float* y) {
  const int64_t groups = K / G, row_bytes = BITS == 4 ? K / 2 : K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wc = codes + n * row_bytes;
    const S* ws = scale + n * groups;
    const S* wl = lo + n * groups;
    float low[ROW_TILE] = {0.f, 0.f, 0.f, 0.f};
#if defined(__AVX2__)
    __m256 acc[ROW_TILE] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < groups; ++g) {
      __m256i u, sign_src;
      if constexpr (BITS == 4) {
        u = unpack4(wc + g * 16);
      } else {  // signed codes: |code| against xq carrying the code's sign
        sign_src = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + g * 32));
        u = _mm256_abs_epi8(sign_src);
      }
      const float sw = static_cast<float>(ws[g]), lw = static_cast<float>(wl[g]);
      for (int64_t t = 0; t < tile; ++t) {
        const int64_t r = r0 + t;
        __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + r * K + g * G));
        if constexpr (BITS == 8) a = _mm256_sign_epi8(a, sign_src);
        const __m256i p = dot_u8s8(u, a);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sw * xq.d[r * groups + g]), acc[t]);
        low[t] += lw * xq.s[r * groups + g];
      }
    }
    for (int64_t t = 0; t < tile; ++t) y[(r0 + t) * N + n] = shardline::hsum(acc[t]) + low[t];
#else
    float acc[ROW_TILE] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t g = 0; g < groups; ++g) {
      const float sw = static_cast<float>(ws[g]), lw = static_cast<float>(wl[g]);
      for (int64_t t = 0; t < tile; ++t) {
        const int64_t r = r0 + t;
        const int8_t* a = xq.q.data() + r * K + g * G;
        int dot = 0;
        for (int j = 0; j < G; ++j) {
          int c;
          if constexpr (BITS == 4) {
            const uint8_t b = wc[g * 16 + (j & 15)];
            c = j < 16 ? (b & 15) : (b >> 4);
          } else {
            c = static_cast<int8_t>(wc[g * 32 + j]);
          }
          dot += c * a[j];
        }
        acc[t] += sw * xq.d[r * groups + g] * static_cast<float>(dot);
        low[t] += lw * xq.s[r * groups + g];
      }
    }
    for (int64_t t = 0; t < tile; ++t) y[(r0 + t) * N + n] = acc[t] + low[t];
#endif
  }
}

}  // namespace

namespace shardline {

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const at::Tensor& lo, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, K] float32");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const auto scale_type = bits == 4 ? at::kHalf : at::kFloat;
  TORCH_CHECK(scale.scalar_type() == scale_type && lo.scalar_type() == scale_type && scale.is_contiguous() &&
              lo.is_contiguous(), "scale and lo must be contiguous, fp16 for 4 bits and fp32 for 8");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = scale.size(0);
  TORCH_CHECK(K % G == 0 && scale.size(1) == K / G && lo.sizes() == scale.sizes(), "shapes disagree");
  TORCH_CHECK(codes.size(0) == N && codes.size(1) == (bits == 4 ? K / 2 : K) && codes.is_contiguous(),
              "codes must be [N, K/2] (4-bit) or [N, K] (8-bit) uint8");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantizedRows xq = quantize_rows(xc.data_ptr<float>(), M, K);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < M; r0 += ROW_TILE) {
      const int64_t tile = std::min(ROW_TILE, M - r0);
      if (bits == 4)
        gemm_tile<4>(xq, r0, tile, K, c, scale.const_data_ptr<c10::Half>(), lo.const_data_ptr<c10::Half>(), n0, n1,
                     N, out);
      else
        gemm_tile<8>(xq, r0, tile, K, c, scale.const_data_ptr<float>(), lo.const_data_ptr<float>(), n0, n1, N, out);
    }
  });
  return y;
}

}  // namespace shardline
