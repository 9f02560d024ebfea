// Shardline's 8-bit linear kernel (shardline_native::int8_linear), in practice the LM head.
//
// Weights are groups of 32 along the input dimension, w = lo + scale * code, with codes as int8
// -128..126 (lo includes the +128 shift from the 0..254 grid) and scale and lo in fp32. As in
// int4_linear.cpp, eight output rows are interleaved across the vector lanes: for each block of 8
// outputs and each pair of weights (2p, 2p + 1), 16 bytes, output 8b + i's two codes at 2i and
// 2i + 1 (`int8_interleave`). So one load sign-extended to int16 is, per lane, the pair of codes of
// one output that multiplies activations 2p and 2p + 1, which one broadcast serves for all 8
// outputs, and a group's scales and los are one load per 8 outputs.
//
// The activations are quantized to int16 per group of 32 as for the 4-bit kernel
// (shardline::int16_rows; a pair of |code| <= 128 times |xq| <= 32767 is one exact vpmaddwd, and a
// group's 16 pairs sum below 2^28). (It multiplied int8 activations as llama.cpp's Q8_0 does, one
// output per vector: per group and row the scale work of a conversion, an FMA and a broadcast cost
// as much as the integer products; interleaved, a 16-row step of SmolLM2's LM head is 2-3x faster.)

#include "native.h"

#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t G = 32;          // weights per group (one scale, one lo)
constexpr int64_t B = 8;           // outputs per block, across the lanes
constexpr int64_t ROW_BLOCK = 4;   // activation rows multiplied against one block

// y[m, 8b + i] for the R activation rows from m0 and the NB blocks of 8 outputs from b0.
template <int NB, int R>
void dot_block(const int8_t* codes, const float* scale, const float* lo, const shardline::Int16Rows& xs, int64_t m0,
               int64_t b0, int64_t K, float* y, int64_t N) {
  const int64_t groups = K / G;
#if defined(__AVX2__)
  __m256 total[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) total[b][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int b = 0; b < NB; ++b)  // the next blocks' group, streamed from memory (prefetches do not fault)
      for (int64_t line = 0; line < G * B; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(codes + ((b0 + NB + b) * K + g * G) * B + line), _MM_HINT_T0);
    __m256i acc[NB][R];
    for (int b = 0; b < NB; ++b)
      for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int p = 0; p < G / 2; ++p) {
      __m256i c[NB];
      for (int b = 0; b < NB; ++b)
        c[b] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + ((b0 + b) * K + g * G + 2 * p) * B)));
      for (int r = 0; r < R; ++r) {
        const int32_t* pairs = reinterpret_cast<const int32_t*>(xs.q.data() + (m0 + r) * K + g * G);
        const __m256i x = _mm256_set1_epi32(pairs[p]);
        for (int b = 0; b < NB; ++b) acc[b][r] = shardline::dot_pairs(acc[b][r], c[b], x);
      }
    }
    for (int b = 0; b < NB; ++b) {
      const __m256 s = _mm256_loadu_ps(scale + ((b0 + b) * groups + g) * B);
      const __m256 z = _mm256_loadu_ps(lo + ((b0 + b) * groups + g) * B);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * groups + g;
        total[b][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[b][r]), _mm256_mul_ps(s, _mm256_set1_ps(xs.d[i])), total[b][r]);
        total[b][r] = _mm256_fmadd_ps(z, _mm256_set1_ps(xs.sum[i]), total[b][r]);
      }
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (m0 + r) * N + (b0 + b) * B, total[b][r]);
#else
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r)
      for (int64_t i = 0; i < B; ++i) {
        const int16_t* xq = xs.q.data() + (m0 + r) * K;
        float acc = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t dot = 0;
          for (int64_t k = 0; k < G; ++k) {
            const int64_t kk = g * G + k;
            dot += codes[((b0 + b) * K + kk - kk % 2) * B + 2 * i + kk % 2] * xq[kk];
          }
          const int64_t at = ((b0 + b) * groups + g) * B + i, row = (m0 + r) * groups + g;
          acc += static_cast<float>(dot) * scale[at] * xs.d[row] + lo[at] * xs.sum[row];
        }
        y[(m0 + r) * N + (b0 + b) * B + i] = acc;
      }
#endif
}

template <int NB, int R>
void dot_rows(const int8_t* codes, const float* scale, const float* lo, const shardline::Int16Rows& xs, int64_t m0,
              int64_t b0, int64_t b1, int64_t K, float* y, int64_t N) {
  int64_t b = b0;
  for (; b + NB <= b1; b += NB) dot_block<NB, R>(codes, scale, lo, xs, m0, b, K, y, N);
  for (; b < b1; ++b) dot_block<1, R>(codes, scale, lo, xs, m0, b, K, y, N);
}

using DotRows = void (*)(const int8_t*, const float*, const float*, const shardline::Int16Rows&, int64_t, int64_t,
                         int64_t, int64_t, float*, int64_t);
constexpr DotRows DOT_ROWS[ROW_BLOCK + 1] = {nullptr, dot_rows<4, 1>, dot_rows<2, 2>, dot_rows<2, 3>, dot_rows<2, 4>};

}  // namespace

namespace shardline {

at::Tensor int8_interleave(const at::Tensor& codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.size(0) % B == 0 && codes.size(1) % G == 0,
              "codes must be [N, K] int8 with N a multiple of ", B, " and K of ", G);
  const int64_t N = codes.size(0), K = codes.size(1);
  // [N/8, 8, K/2, 2] -> [N/8, K/2, 8, 2]: per block, each pair of weights' codes for its 8 outputs
  return codes.contiguous().view({N / B, B, K / 2, 2}).transpose(1, 2).contiguous().view({N, K});
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& lo) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, K] float32");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = codes.size(0);
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.size(1) == K && codes.is_contiguous() &&
              N % B == 0 && K % G == 0, "codes must be int8_interleave's [N, K] int8 for K = ", K);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && lo.scalar_type() == at::kFloat && scale.is_contiguous() &&
              lo.is_contiguous() && scale.dim() == 3 && scale.size(0) == N / B && scale.size(1) == K / G &&
              scale.size(2) == B && lo.sizes() == scale.sizes(),
              "scale and lo must be [N/8, K/32, 8] float32, a block's 8 outputs innermost");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const Int16Rows rows = int16_rows(xc.const_data_ptr<float>(), M, K);
  const int8_t* c = codes.const_data_ptr<int8_t>();
  const float* s = scale.const_data_ptr<float>();
  const float* l = lo.const_data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N / B, 2, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) DOT_ROWS[std::min(ROW_BLOCK, M - m0)](c, s, l, rows, m0, b0, b1, K, out, N);
  });
  return y;
}

}  // namespace shardline
