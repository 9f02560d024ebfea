// Shardline's 4-bit linear kernel (shardline_native::int4_linear), fp32 activations.
//
// Weights are groups of 32 along the input dimension, w = lo + scale * code with codes 0..15
// (GGUF's Q4_0, Q4_1 and Q4_K blocks are such groups: kernels/grid.py), held 4 bits each in
// tiles of 64 weights (the input dimension padded with zero weights to whole tiles): 8 int32 words, the word of lane j holding in its nibble i the code of
// weight 8i + j. So one 256-bit load holds a tile, and nibble i of all lanes is the 8 codes
// multiplied by the 8 contiguous activations x[8i .. 8i+8): no shuffles. A tile is two groups
// (nibbles 0-3 and 4-7).
//
// The activations stay fp32, so a row's result is the dequantized weights' up to the order of
// summation (quantizing them to int8, as llama.cpp does, cost SmolLM2 its quality gate). Codes are
// taken from their nibbles with one AND, unshifted: nibble i's value is code * 16^i, exact in
// fp32, and the activations it multiplies were scaled by 16^-i once per call (nibble 7 is shifted
// instead: its sign bit). Per tile and activation row: 8 FMAs into a group's sum, and two more
// to scale the two groups; the `lo` terms are one short dot per output, lo . (sums of x per group).
//
// Decode's few rows (`rows <= max_direct_rows`) are multiplied so, straight from the codes, each
// tile unpacked once per four rows. More rows (prefill, long chunks) dequantize the weights in
// slices of output rows into an fp32 buffer and multiply each slice with torch's GEMM: the
// unpacking is then paid once per slice for all rows, and no dense copy is kept.

#include "native.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t G = 32;            // weights per group (one scale, one lo)
constexpr int64_t TILE = 64;         // weights per tile: 8 lanes x 8 nibbles
constexpr int64_t WORDS = TILE / 8;  // int32 words per tile
constexpr int64_t ROW_BLOCK = 4;     // activation rows multiplied against one unpacked tile
constexpr int64_t SLICE_BYTES = 1 << 20;  // fp32 weights dequantized at once on the GEMM path

inline float nibble_weight(int64_t i) { return i == 7 ? 1.f : 1.f / static_cast<float>(1 << (4 * i)); }

// x [M, K] -> x padded with zeros to Kp (whole tiles), weight 8i + j of each tile scaled by 16^-i
// (nibble_weight), and the sum of x over each group [M, Kp/32].
void prepare_rows(const float* x, int64_t M, int64_t K, int64_t Kp, float* scaled, float* sums) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < Kp; ++k) scaled[m * Kp + k] = k < K ? x[m * K + k] * nibble_weight((k % TILE) / 8) : 0.f;
    for (int64_t g = 0; g < Kp / G; ++g) {
      float s = 0.f;
      for (int64_t j = g * G; j < std::min(K, (g + 1) * G); ++j) s += x[m * K + j];
      sums[m * (Kp / G) + g] = s;
    }
  }
}

// y[m, n] for the R activation rows from m0 and the NB outputs from n0 (constants, so that the sums
// stay in registers). The two groups of a tile sum into separate registers, so NB * R * 2 chains
// of FMAs are in flight: at one row and one output, two chains would leave the FMA units waiting
// on their latency.
template <int NB, int R>
void dot_block(const int32_t* words, const float* scale, const float* lo, const float* xs, const float* sums,
               int64_t m0, int64_t n0, int64_t K, float* y, int64_t N) {
  const int64_t groups = K / G, tiles = K / TILE, stride = K / 8;
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = xs + (m0 + r) * K;
  float out[NB][R];
#if defined(__AVX2__)
  __m256 total[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) total[b][r] = _mm256_setzero_ps();
  for (int64_t t = 0; t < tiles; ++t) {
    __m256i w[NB];
    __m256 acc[NB][R][2];
    for (int b = 0; b < NB; ++b) {
      // the next block's tile: decode's weights stream from L3 or memory, once per step
      _mm_prefetch(reinterpret_cast<const char*>(words + (n0 + NB + b) * stride + t * WORDS), _MM_HINT_T0);
      w[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + (n0 + b) * stride + t * WORDS));
      for (int r = 0; r < R; ++r) acc[b][r][0] = acc[b][r][1] = _mm256_setzero_ps();
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      __m256 x[R];
      for (int r = 0; r < R; ++r) x[r] = _mm256_loadu_ps(xr[r] + t * TILE + 8 * i);
      for (int b = 0; b < NB; ++b) {
        const __m256i bits = i == 7 ? _mm256_srli_epi32(w[b], 28) : _mm256_and_si256(w[b], _mm256_set1_epi32(0xF << (4 * i)));
        const __m256 c = _mm256_cvtepi32_ps(bits);
        for (int r = 0; r < R; ++r) acc[b][r][i / 4] = _mm256_fmadd_ps(c, x[r], acc[b][r][i / 4]);
      }
    }
    for (int b = 0; b < NB; ++b) {
      const __m256 s0 = _mm256_set1_ps(scale[(n0 + b) * groups + 2 * t]);
      const __m256 s1 = _mm256_set1_ps(scale[(n0 + b) * groups + 2 * t + 1]);
      for (int r = 0; r < R; ++r)
        total[b][r] = _mm256_fmadd_ps(acc[b][r][1], s1, _mm256_fmadd_ps(acc[b][r][0], s0, total[b][r]));
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) out[b][r] = shardline::hsum(total[b][r]);
#else
  for (int b = 0; b < NB; ++b) {
    for (int r = 0; r < R; ++r) out[b][r] = 0.f;
    const uint32_t* row = reinterpret_cast<const uint32_t*>(words + (n0 + b) * stride);
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t i = 0; i < 8; ++i) {
        const float s = scale[(n0 + b) * groups + 2 * t + i / 4];
        for (int64_t j = 0; j < 8; ++j) {
          const uint32_t word = row[t * WORDS + j];
          const float c = i == 7 ? static_cast<float>(word >> 28) : static_cast<float>(static_cast<int32_t>(word & (0xFu << (4 * i))));
          for (int r = 0; r < R; ++r) out[b][r] += s * c * xr[r][t * TILE + 8 * i + j];
        }
      }
  }
#endif
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) {
      float low = 0.f;
      const float* xsum = sums + (m0 + r) * groups;
      const float* l = lo + (n0 + b) * groups;
      for (int64_t g = 0; g < groups; ++g) low += l[g] * xsum[g];
      y[(m0 + r) * N + n0 + b] = out[b][r] + low;
    }
}

// A block shape per activation rows left (1 to ROW_BLOCK), each with 8 chains of FMAs; and the
// one-output shape of the same rows, for the last outputs when NB does not divide N.
template <int NB, int R>
void dot_rows(const int32_t* words, const float* scale, const float* lo, const float* xs, const float* sums,
              int64_t m0, int64_t n0, int64_t n1, int64_t K, float* y, int64_t N) {
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) dot_block<NB, R>(words, scale, lo, xs, sums, m0, n, K, y, N);
  for (; n < n1; ++n) dot_block<1, R>(words, scale, lo, xs, sums, m0, n, K, y, N);
}

using DotRows = void (*)(const int32_t*, const float*, const float*, const float*, const float*, int64_t, int64_t,
                         int64_t, int64_t, float*, int64_t);
constexpr DotRows DOT_ROWS[ROW_BLOCK + 1] = {nullptr, dot_rows<4, 1>, dot_rows<2, 2>, dot_rows<1, 3>, dot_rows<1, 4>};

// K: the padded input dimension (x's is padded as it is prepared).
at::Tensor direct(const at::Tensor& x, const int32_t* words, const float* scale, const float* lo, int64_t N, int64_t K) {
  const int64_t M = x.size(0), groups = K / G;
  std::vector<float> scaled(M * K), sums(M * groups);
  prepare_rows(x.const_data_ptr<float>(), M, x.size(1), K, scaled.data(), sums.data());
  at::Tensor y = at::empty({M, N}, x.options());
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK)
      DOT_ROWS[std::min(ROW_BLOCK, M - m0)](words, scale, lo, scaled.data(), sums.data(), m0, n0, n1, K, out, N);
  });
  return y;
}

// Rows [n0, n1) of the weights, fp32, into w [n1 - n0, K].
void dequantize(const int32_t* words, const float* scale, const float* lo, int64_t K, int64_t n0, int64_t n1, float* w) {
  const int64_t groups = K / G;
  at::parallel_for(n0, n1, 4, [&](int64_t a, int64_t b) {
    for (int64_t n = a; n < b; ++n) {
      const int32_t* row = words + n * (K / 8);
      float* out = w + (n - n0) * K;
      for (int64_t t = 0; t < K / TILE; ++t) {
#if defined(__AVX2__)
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + t * WORDS));
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          const __m256 c = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4 * i), _mm256_set1_epi32(0xF)));
          const int64_t g = n * groups + 2 * t + i / 4;
          _mm256_storeu_ps(out + t * TILE + 8 * i, _mm256_fmadd_ps(c, _mm256_set1_ps(scale[g]), _mm256_set1_ps(lo[g])));
        }
#else
        for (int64_t i = 0; i < 8; ++i) {
          const float s = scale[n * groups + 2 * t + i / 4], l = lo[n * groups + 2 * t + i / 4];
          for (int64_t j = 0; j < 8; ++j)
            out[t * TILE + 8 * i + j] = l + s * static_cast<float>((static_cast<uint32_t>(row[t * WORDS + j]) >> (4 * i)) & 0xF);
        }
#endif
      }
    }
  });
}

at::Tensor through_gemm(const at::Tensor& x, const int32_t* words, const float* scale, const float* lo, int64_t N,
                        int64_t K) {
  const int64_t M = x.size(0);
  const int64_t slice = std::max<int64_t>(16, SLICE_BYTES / (4 * K));
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor w = at::empty({std::min(slice, N), K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += slice) {
    const int64_t n1 = std::min(N, n0 + slice);
    dequantize(words, scale, lo, K, n0, n1, w.data_ptr<float>());
    y.slice(1, n0, n1).copy_(at::mm(x, w.slice(0, 0, n1 - n0).slice(1, 0, x.size(1)).t()));
  }
  return y;
}

}  // namespace

namespace shardline {

at::Tensor int4_pack(const at::Tensor& codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) % G == 0, "codes must be [N, K] with K a multiple of ", G);
  const int64_t pad = (TILE - codes.size(1) % TILE) % TILE;  // zero codes, for zero scale and lo
  const at::Tensor c = at::constant_pad_nd(codes.to(at::kInt), {0, pad}).contiguous();
  const int64_t N = c.size(0), K = c.size(1);
  at::Tensor packed = at::empty({N, K / 8}, c.options());
  const int32_t* src = c.const_data_ptr<int32_t>();
  uint32_t* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t t = 0; t < K / TILE; ++t)
        for (int64_t j = 0; j < 8; ++j) {
          uint32_t word = 0;
          for (int64_t i = 0; i < 8; ++i) word |= static_cast<uint32_t>(src[n * K + t * TILE + 8 * i + j] & 0xF) << (4 * i);
          dst[n * (K / 8) + t * WORDS + j] = word;
        }
  });
  return packed;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& lo,
                       int64_t max_direct_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, K] float32");
  const at::Tensor xc = x.contiguous();
  const int64_t N = scale.size(0), K = packed.size(1) * 8;  // K: padded to whole tiles
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.is_contiguous() && packed.size(0) == N && K % TILE == 0 &&
              xc.size(1) <= K && K - xc.size(1) < TILE, "packed must be int4_pack's [N, K/8] int32 for K = ", xc.size(1));
  TORCH_CHECK(scale.scalar_type() == at::kFloat && lo.scalar_type() == at::kFloat && scale.is_contiguous() &&
              lo.is_contiguous() && scale.size(1) == K / G && lo.sizes() == scale.sizes(),
              "scale and lo must be [N, K/32] float32, padded with zeros as the codes are");
  if (xc.size(0) == 0) return at::empty({0, N}, x.options());
  const int32_t* w = packed.const_data_ptr<int32_t>();
  return xc.size(0) <= max_direct_rows ? direct(xc, w, scale.const_data_ptr<float>(), lo.const_data_ptr<float>(), N, K)
                                       : through_gemm(xc, w, scale.const_data_ptr<float>(), lo.const_data_ptr<float>(), N, K);
}

}  // namespace shardline
