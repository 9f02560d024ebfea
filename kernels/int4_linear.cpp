// Shardline's 4-bit linear kernel (shardline_native::int4_linear).
//
// Weights are groups of 32 along the input dimension, w = lo + scale * code with codes 0..15
// (GGUF's Q4_0, Q4_1 and Q4_K blocks are such groups: kernels/grid.py), held 4 bits each with
// eight output rows interleaved across the vector lanes: for each block of 8 outputs and each
// group, 4 loads of 8 int32 words, the word of lane i in load l holding in its bits 4q..4q+3 the
// code of output 8b + i for weight 2p and in bits 16+4q.. that for weight 2p + 1 (p = 4l + q, the
// weights counted within the group). So (word >> 4q) & 0x000F000F is, per lane, the int16 pair of
// codes of one output that multiplies the activations 2p and 2p + 1, which one broadcast serves for
// all 8 outputs; and a group's scales and los are one load per 8 outputs. (Laid out per output
// instead, each output's lanes held partial sums, and every group cost per output and row a
// conversion, an FMA and a broadcast of its scale: 1.6-1.7x slower at 1 to 32 rows, AVX2.)
//
// Decode's rows (`rows <= max_direct_rows`) are multiplied straight from the codes, with the
// activations quantized to int16 per group of 32 (x ~= dx * xq, |xq| <= 32767; a relative error
// of 2^-16 of the group's largest value, far below bf16's 2^-9, and llama.cpp's int8 activations
// cost SmolLM2 its quality gate here): each pair of codes times a pair of activations is one
// integer multiply-add (vpmaddwd, or VNNI's vpdpwssd with the add fused), exact, and a group's sums
// for 8 outputs are converted and scaled once, the group's lo term (lo times the group's fp32 sum
// of x) one more FMA.
//
// More rows (prefill, long chunks) dequantize the weights in slices of output rows into an fp32
// buffer and multiply each slice with torch's GEMM in fp32: the unpacking is paid once per slice
// for all rows, and no dense copy is kept. (An int8 GEMM there, activations per row and weights
// requantized per output row, was 1.7x faster at 512 rows on AVX2 and cost SmolLM2 its quality
// gate: same top-1 90.5%.)

#include "native.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t G = 32;            // weights per group (one scale, one lo)
constexpr int64_t B = 8;             // outputs per block, across the lanes
constexpr int64_t WORDS = 4 * B;     // int32 words per block and group: 4 loads of 8 lanes
constexpr int64_t ROW_BLOCK = 4;     // activation rows multiplied against one unpacked block
constexpr int64_t SLICE_BYTES = 1 << 20;  // fp32 weights dequantized at once on the GEMM path


// The code of output 8b + i for weight k of group g (the layout above), for the scalar paths.
inline int32_t code_at(const int32_t* words, int64_t groups, int64_t b, int64_t i, int64_t g, int64_t k) {
  const int64_t p = k / 2, l = p / 4, q = p % 4;
  const uint32_t word = static_cast<uint32_t>(words[((b * groups + g) * 4 + l) * B + i]);
  return static_cast<int32_t>((word >> (4 * q + 16 * (k % 2))) & 0xF);
}

// y[m, 8b + i] for the R activation rows from m0 and the NB blocks of 8 outputs from b0
// (constants, so that the sums stay in registers).
template <int NB, int R>
void dot_block(const int32_t* words, const float* scale, const float* lo, const shardline::Int16Rows& xs, int64_t m0, int64_t b0,
               int64_t K, float* y, int64_t N) {
  const int64_t groups = K / G;
#if defined(__AVX2__)
  const __m256i low = _mm256_set1_epi32(0x000F000F);
  __m256 total[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) total[b][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // the next blocks' group: decode's weights stream from L3 or memory, once per step (past the
    // last block this touches nothing: prefetches do not fault)
    for (int b = 0; b < NB; ++b)
      for (int64_t line = 0; line < WORDS * 4; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(words + ((b0 + NB + b) * groups + g) * WORDS) + line, _MM_HINT_T0);
    __m256i acc[NB][R];
    for (int b = 0; b < NB; ++b)
      for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) {
      __m256i w[NB];
      for (int b = 0; b < NB; ++b)
        w[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + ((b0 + b) * groups + g) * WORDS + l * B));
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        __m256i codes[NB];
        for (int b = 0; b < NB; ++b) codes[b] = _mm256_and_si256(q == 0 ? w[b] : _mm256_srli_epi32(w[b], 4 * q), low);
        for (int r = 0; r < R; ++r) {
          const int32_t* pairs = reinterpret_cast<const int32_t*>(xs.q.data() + (m0 + r) * K + g * G);
          const __m256i x = _mm256_set1_epi32(pairs[4 * l + q]);
          for (int b = 0; b < NB; ++b) acc[b][r] = shardline::dot_pairs(acc[b][r], codes[b], x);
        }
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
          for (int64_t k = 0; k < G; ++k) dot += code_at(words, groups, b0 + b, i, g, k) * xq[g * G + k];
          const int64_t at = ((b0 + b) * groups + g) * B + i, row = (m0 + r) * groups + g;
          acc += static_cast<float>(dot) * scale[at] * xs.d[row] + lo[at] * xs.sum[row];
        }
        y[(m0 + r) * N + (b0 + b) * B + i] = acc;
      }
#endif
}

// Blocks [b0, b1) in runs of NB, the last ones one at a time.
template <int NB, int R>
void dot_rows(const int32_t* words, const float* scale, const float* lo, const shardline::Int16Rows& xs, int64_t m0, int64_t b0,
              int64_t b1, int64_t K, float* y, int64_t N) {
  int64_t b = b0;
  for (; b + NB <= b1; b += NB) dot_block<NB, R>(words, scale, lo, xs, m0, b, K, y, N);
  for (; b < b1; ++b) dot_block<1, R>(words, scale, lo, xs, m0, b, K, y, N);
}

// A block shape per activation rows left (1 to ROW_BLOCK), measured (AVX2, SmolLM2's layers):
// four blocks at one row, two at more.
using DotRows = void (*)(const int32_t*, const float*, const float*, const shardline::Int16Rows&, int64_t, int64_t, int64_t, int64_t,
                         float*, int64_t);
constexpr DotRows DOT_ROWS[ROW_BLOCK + 1] = {nullptr, dot_rows<4, 1>, dot_rows<2, 2>, dot_rows<2, 3>, dot_rows<2, 4>};

at::Tensor direct(const at::Tensor& x, const int32_t* words, const float* scale, const float* lo, int64_t N, int64_t K) {
  const int64_t M = x.size(0);
  const shardline::Int16Rows rows = shardline::int16_rows(x.const_data_ptr<float>(), M, K);
  at::Tensor y = at::empty({M, N}, x.options());
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N / B, 2, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK)
      DOT_ROWS[std::min(ROW_BLOCK, M - m0)](words, scale, lo, rows, m0, b0, b1, K, out, N);
  });
  return y;
}

// Output rows [8 b0, 8 b1) of the weights, fp32 and transposed, into wt [K, ld]: a block's 8
// outputs are 8 adjacent columns, so each pair of codes unpacks to two rows of 8 floats.
void dequantize(const int32_t* words, const float* scale, const float* lo, int64_t K, int64_t b0, int64_t b1, float* wt,
                int64_t ld) {
  const int64_t groups = K / G;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t at = (b * groups + g) * B;
        float* out = wt + g * G * ld + (b - b0) * B;
#if defined(__AVX2__)
        const __m256 s = _mm256_loadu_ps(scale + at), z = _mm256_loadu_ps(lo + at);
        const __m256i nibble = _mm256_set1_epi32(0xF);
        for (int l = 0; l < 4; ++l) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + at * 4 + l * B));
#pragma GCC unroll 8
          for (int h = 0; h < 8; ++h) {  // weight 2p + h % 2 of the group, p = 4l + h / 2
            const __m256 c = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, 4 * (h / 2) + 16 * (h % 2)), nibble));
            _mm256_storeu_ps(out + (8 * l + h) * ld, _mm256_fmadd_ps(c, s, z));
          }
        }
#else
        for (int64_t k = 0; k < G; ++k)
          for (int64_t i = 0; i < B; ++i)
            out[k * ld + i] = lo[at + i] + scale[at + i] * static_cast<float>(code_at(words, groups, b, i, g, k));
#endif
      }
  });
}

at::Tensor through_gemm(const at::Tensor& x, const int32_t* words, const float* scale, const float* lo, int64_t N,
                        int64_t K) {
  const int64_t M = x.size(0);
  const int64_t slice = std::max<int64_t>(2, SLICE_BYTES / (4 * K * B)) * B;  // outputs, whole blocks
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor wt = at::empty({K, std::min(slice, N)}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += slice) {
    const int64_t n1 = std::min(N, n0 + slice);
    dequantize(words, scale, lo, K, n0 / B, n1 / B, wt.data_ptr<float>(), wt.size(1));
    y.slice(1, n0, n1).copy_(at::mm(x, wt.slice(1, 0, n1 - n0)));
  }
  return y;
}

#if defined(__AVX2__)
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace

namespace shardline {

Int16Rows int16_rows(const float* x, int64_t M, int64_t K) {
  const int64_t groups = K / G;
  Int16Rows rows{std::vector<int16_t>(M * K), std::vector<float>(M * groups), std::vector<float>(M * groups)};
  at::parallel_for(0, M * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // group i of the rows, as x is laid out
      const float* xg = x + i * G;
      int16_t* q = rows.q.data() + i * G;
#if defined(__AVX2__)
      const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      __m256 v[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(xg + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], magnitude));
        sum = _mm256_add_ps(sum, v[j]);
      }
      const float top = hmax(amax);
      const __m256 inv = _mm256_set1_ps(top > 0.f ? 32767.f / top : 0.f);
      for (int j = 0; j < 4; j += 2) {  // rounded to nearest; packs interleave the 128-bit halves, the permute undoes it
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)), b = _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], inv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * j), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
      }
      rows.d[i] = top / 32767.f;
      rows.sum[i] = shardline::hsum(sum);
#else
      float top = 0.f, sum = 0.f;
      for (int j = 0; j < G; ++j) top = std::max(top, std::fabs(xg[j])), sum += xg[j];
      const float inv = top > 0.f ? 32767.f / top : 0.f;
      for (int j = 0; j < G; ++j) q[j] = static_cast<int16_t>(std::nearbyint(xg[j] * inv));
      rows.d[i] = top / 32767.f;
      rows.sum[i] = sum;
#endif
    }
  });
  return rows;
}


at::Tensor int4_pack(const at::Tensor& codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) % G == 0 && codes.size(0) % B == 0,
              "codes must be [N, K] with N a multiple of ", B, " and K of ", G);
  const at::Tensor c = codes.to(at::kInt).contiguous();
  const int64_t N = c.size(0), K = c.size(1), groups = K / G;
  at::Tensor packed = at::empty({N, K / 8}, c.options());
  const int32_t* src = c.const_data_ptr<int32_t>();
  uint32_t* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  at::parallel_for(0, N / B, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t l = 0; l < 4; ++l)
          for (int64_t i = 0; i < B; ++i) {
            uint32_t word = 0;
            for (int64_t q = 0; q < 4; ++q)
              for (int64_t odd = 0; odd < 2; ++odd)
                word |= static_cast<uint32_t>(src[(b * B + i) * K + g * G + 2 * (4 * l + q) + odd] & 0xF) << (4 * q + 16 * odd);
            dst[((b * groups + g) * 4 + l) * B + i] = word;
          }
  });
  return packed;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& lo,
                       int64_t max_direct_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, K] float32");
  const at::Tensor xc = x.contiguous();
  const int64_t N = packed.size(0), K = packed.size(1) * 8;
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.is_contiguous() && N % B == 0 && xc.size(1) == K,
              "packed must be int4_pack's [N, K/8] int32 for K = ", xc.size(1));
  TORCH_CHECK(scale.scalar_type() == at::kFloat && lo.scalar_type() == at::kFloat && scale.is_contiguous() &&
              lo.is_contiguous() && scale.dim() == 3 && scale.size(0) == N / B && scale.size(1) == K / G &&
              scale.size(2) == B && lo.sizes() == scale.sizes(),
              "scale and lo must be [N/8, K/32, 8] float32, a block's 8 outputs innermost");
  if (xc.size(0) == 0) return at::empty({0, N}, x.options());
  const int32_t* w = packed.const_data_ptr<int32_t>();
  return xc.size(0) <= max_direct_rows ? direct(xc, w, scale.const_data_ptr<float>(), lo.const_data_ptr<float>(), N, K)
                                       : through_gemm(xc, w, scale.const_data_ptr<float>(), lo.const_data_ptr<float>(), N, K);
}

}  // namespace shardline
