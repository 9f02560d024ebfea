// The direct path that the 4- and 8-bit kernels share (int4_linear.cpp, int8_linear.cpp): 8
// outputs across the vector lanes, activations as int16 per group of 32 (shardline::int16_rows).
//
// Only how a block's codes are held differs, and a `Codes` type says it (AVX2 first):
//   PAIRS:          pairs of weights per load (a group's 16 pairs take 16 / PAIRS loads);
//   load(b, g, l):  load l of block b's group g;
//   pairs(w, q):    from a load, per lane i, the int16 pair of codes of output 8b + i for the
//                   group's weights 2p and 2p + 1, p = l * PAIRS + q;
//   prefetch(b, g): the cache lines of block b's group g;
//   at(b, i, g, k): output 8b + i's code for weight k of group g (the scalar path).
// Scales and los are [N/8, K/32, 8]: a block's 8 outputs side by side per group.
#pragma once

#include "native.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>

namespace shardline::interleaved {

constexpr int64_t G = 32;         // weights per group (one scale, one lo)
constexpr int64_t B = 8;          // outputs per block, across the lanes
constexpr int64_t ROW_BLOCK = 4;  // activation rows multiplied against one block's codes

// y[m, 8b + i] for the R activation rows from m0 and the NB blocks of 8 outputs from b0
// (constants, so that the sums stay in registers).
template <typename Codes, int NB, int R>
void dot_block(const Codes& codes, const float* scale, const float* lo, const Int16Rows& xs, int64_t m0, int64_t b0,
               int64_t K, float* y, int64_t N) {
  const int64_t groups = K / G;
#if defined(__AVX2__)
  __m256 total[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) total[b][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // the next blocks' group: decode's weights stream from L3 or memory, once per step (past the
    // last block this touches nothing: prefetches do not fault)
    for (int b = 0; b < NB; ++b) codes.prefetch(b0 + NB + b, g);
    __m256i acc[NB][R];
    for (int b = 0; b < NB; ++b)
      for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_si256();
#pragma GCC unroll 4  // 4-bit: the whole group; 8-bit: 4 of its 16 loads (unrolled whole it ran 1.4x slower on AVX2)
    for (int l = 0; l < G / 2 / Codes::PAIRS; ++l) {
      __m256i w[NB];
      for (int b = 0; b < NB; ++b) w[b] = codes.load(b0 + b, g, l);
#pragma GCC unroll 4
      for (int q = 0; q < Codes::PAIRS; ++q) {
        __m256i c[NB];
        for (int b = 0; b < NB; ++b) c[b] = codes.pairs(w[b], q);
        for (int r = 0; r < R; ++r) {
          const int32_t* pairs = reinterpret_cast<const int32_t*>(xs.q.data() + (m0 + r) * K + g * G);
          const __m256i x = _mm256_set1_epi32(pairs[l * Codes::PAIRS + q]);
          for (int b = 0; b < NB; ++b) acc[b][r] = dot_pairs(acc[b][r], c[b], x);
        }
      }
    }
    for (int b = 0; b < NB; ++b) {  // the group's sums scaled, and its lo term: 8 outputs at once
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
          for (int64_t k = 0; k < G; ++k) dot += codes.at(b0 + b, i, g, k) * xq[g * G + k];
          const int64_t at = ((b0 + b) * groups + g) * B + i, row = (m0 + r) * groups + g;
          acc += static_cast<float>(dot) * scale[at] * xs.d[row] + lo[at] * xs.sum[row];
        }
        y[(m0 + r) * N + (b0 + b) * B + i] = acc;
      }
#endif
}

// Blocks [b0, b1) in runs of NB, the last ones one at a time.
template <typename Codes, int NB, int R>
void dot_rows(const Codes& codes, const float* scale, const float* lo, const Int16Rows& xs, int64_t m0, int64_t b0,
              int64_t b1, int64_t K, float* y, int64_t N) {
  int64_t b = b0;
  for (; b + NB <= b1; b += NB) dot_block<Codes, NB, R>(codes, scale, lo, xs, m0, b, K, y, N);
  for (; b < b1; ++b) dot_block<Codes, 1, R>(codes, scale, lo, xs, m0, b, K, y, N);
}

// x [M, K] fp32 times the weights that `codes`, scale and lo hold -> [M, N]. A block shape per
// activation rows left (1 to ROW_BLOCK), measured (AVX2, SmolLM2's layers): four blocks at one
// row, two at more.
template <typename Codes>
at::Tensor multiply(const Codes& codes, const at::Tensor& x, const float* scale, const float* lo, int64_t N) {
  using DotRows = void (*)(const Codes&, const float*, const float*, const Int16Rows&, int64_t, int64_t, int64_t,
                           int64_t, float*, int64_t);
  constexpr DotRows DOT_ROWS[ROW_BLOCK + 1] = {nullptr, dot_rows<Codes, 4, 1>, dot_rows<Codes, 2, 2>,
                                               dot_rows<Codes, 2, 3>, dot_rows<Codes, 2, 4>};
  const int64_t M = x.size(0), K = x.size(1);
  const Int16Rows rows = int16_rows(x.const_data_ptr<float>(), M, K);
  at::Tensor y = at::empty({M, N}, x.options());
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N / B, 2, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK)
      DOT_ROWS[std::min(ROW_BLOCK, M - m0)](codes, scale, lo, rows, m0, b0, b1, K, out, N);
  });
  return y;
}

}  // namespace shardline::interleaved
