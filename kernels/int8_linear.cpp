// Shardline's int8 linear kernel (shardline_native::int8_linear), as llama.cpp multiplies Q8_0.
//
// Weights are held in groups of 32 along the input dimension, w = lo + scale * code, with codes
// as int8 -128..127 (lo includes a +128 shift from the 0..254 grid) and scale and lo in fp32.
// Activations are quantized to int8 per group of 32 (x ~= dx * xq), so each group's dot product
// is an integer one (AVX2 maddubs with the sign trick, or AVX-512 VNNI dpbusd where the compiler
// targets it): y = sum_g scale * dx * dot(code, xq) + lo * dx * sum(xq).
//
// Only 8-bit layers: with 4-bit ones (built, then measured and removed) the int8 activations on
// every layer cost SmolLM2 its quality gate (same top-1 96.7% against 97% over 1024 tokens);
// torch's int4 kernel, with bf16 activations, multiplies those.

#include "native.h"

#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

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
// 8 partial int32 sums of a 32-byte group: unsigned |codes| times signed activations.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else  // exact: pair sums of |code| <= 128 times |xq| <= 127 fit int16
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

#endif

// y[r, n] for rows [r0, r0 + tile) and outputs [n0, n1).
void gemm_tile(const QuantizedRows& xq, int64_t r0, int64_t tile, int64_t K, const int8_t* codes,
               const float* scale, const float* lo, int64_t n0, int64_t n1, int64_t N, float* y) {
  const int64_t groups = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wc = codes + n * K;
    const float* ws = scale + n * groups;
    const float* wl = lo + n * groups;
    float low[ROW_TILE] = {0.f, 0.f, 0.f, 0.f};
#if defined(__AVX2__)
    __m256 acc[ROW_TILE] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < groups; ++g) {
      // signed codes: |code| (unsigned) against xq carrying the code's sign
      const __m256i sign_src = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + g * 32));
      const __m256i u = _mm256_abs_epi8(sign_src);
      const float sw = ws[g], lw = wl[g];
      for (int64_t t = 0; t < tile; ++t) {
        const int64_t r = r0 + t;
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + r * K + g * G));
        const __m256i p = dot_u8s8(u, _mm256_sign_epi8(a, sign_src));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sw * xq.d[r * groups + g]), acc[t]);
        low[t] += lw * xq.s[r * groups + g];
      }
    }
    for (int64_t t = 0; t < tile; ++t) y[(r0 + t) * N + n] = shardline::hsum(acc[t]) + low[t];
#else
    float acc[ROW_TILE] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t g = 0; g < groups; ++g) {
      const float sw = ws[g], lw = wl[g];
      for (int64_t t = 0; t < tile; ++t) {
        const int64_t r = r0 + t;
        const int8_t* a = xq.q.data() + r * K + g * G;
        int dot = 0;
        for (int j = 0; j < G; ++j) dot += wc[g * G + j] * a[j];
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

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& lo) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, K] float32");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && lo.scalar_type() == at::kFloat && scale.is_contiguous() &&
              lo.is_contiguous(), "scale and lo must be contiguous float32");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = scale.size(0);
  TORCH_CHECK(K % G == 0 && scale.size(1) == K / G && lo.sizes() == scale.sizes(), "shapes disagree");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.size(0) == N && codes.size(1) == K &&
              codes.is_contiguous(), "codes must be [N, K] int8");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantizedRows xq = quantize_rows(xc.data_ptr<float>(), M, K);
  const int8_t* c = codes.const_data_ptr<int8_t>();
  const float* s = scale.const_data_ptr<float>();
  const float* l = lo.const_data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < M; r0 += ROW_TILE) gemm_tile(xq, r0, std::min(ROW_TILE, M - r0), K, c, s, l, n0, n1, N, out);
  });
  return y;
}

}  // namespace shardline
