// Shardline's 4-bit linear kernel (shardline_native::int4_linear).
//
// Weights are groups of 32 along the input dimension, w = lo + scale * code with codes 0..15
// (GGUF's Q4_0, Q4_1 and Q4_K blocks are such groups: kernels/grid.py), held 4 bits each in
// tiles of 64 weights (the input dimension padded with zero weights to whole tiles): 8 int32
// words, the word of lane j holding in its bits 4q..4q+3 the code of weight 16q + j and in bits
// 16+4q.. that of weight 16q + 8 + j (q = 0..3). So one 256-bit load holds a tile, and
// (word >> 4q) & 0x000F000F is, per 32-bit lane, the int16 pair of codes that multiplies the
// activations 16q + j and 16q + 8 + j: no shuffles. A tile is two groups (q = 0, 1 and 2, 3).
//
// Decode's rows (`rows <= max_direct_rows`) are multiplied straight from the codes, with the
// activations quantized to int16 per group of 32 (x ~= dx * xq, |xq| <= 32767; a relative error
// of 2^-16 of the group's largest value, far below bf16's 2^-9, and llama.cpp's int8 activations
// cost SmolLM2 its quality gate here): each pair of codes times a pair of activations is one
// integer multiply-add (vpmaddwd), exact, and a group's sum is converted and scaled once, so a
// tile costs per row 4 multiply-adds, 2 adds, 2 conversions and 2 FMAs (fp32 activations cost 8
// conversions and 10 FMAs: decode on two cores is bound by those). The `lo` terms are one short
// dot per output, lo . (fp32 sums of x per group).
//
// More rows (prefill, long chunks) dequantize the weights in slices of output rows into an fp32
// buffer and multiply each slice with torch's GEMM in fp32: the unpacking is paid once per slice
// for all rows, and no dense copy is kept.

#include "native.h"

#include <ATen/Parallel.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t G = 32;            // weights per group (one scale, one lo)
constexpr int64_t TILE = 64;         // weights per tile: 8 lanes x 8 nibbles
constexpr int64_t WORDS = TILE / 8;  // int32 words per tile
constexpr int64_t ROW_BLOCK = 4;     // activation rows multiplied against one unpacked tile
constexpr int64_t SLICE_BYTES = 1 << 20;  // fp32 weights dequantized at once on the GEMM path

// Where weight k's activation goes in a row of int16 pairs: in each tile, the pair of lane j for
// q holds activations 16q + j and 16q + 8 + j, as the codes' nibbles are placed.
inline int64_t pair_slot(int64_t k) {
  const int64_t t = k / TILE, q = (k % TILE) / 16, j = k % 8, high = (k % 16) / 8;
  return t * TILE + q * 16 + 2 * j + high;
}

// The rows of x [M, K] quantized per group for the direct path, with K padded to whole tiles (Kp).
struct Rows {
  std::vector<int16_t> q;  // [M, Kp] in pair order (pair_slot)
  std::vector<float> d;    // [M, Kp/32] each group's scale: x ~= d * q
  std::vector<float> sum;  // [M, Kp/32] each group's fp32 sum of x (for the lo terms)
};

Rows prepare_rows(const float* x, int64_t M, int64_t K, int64_t Kp) {
  const int64_t groups = Kp / G;
  Rows rows{std::vector<int16_t>(M * Kp, 0), std::vector<float>(M * groups, 0.f), std::vector<float>(M * groups, 0.f)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t k0 = g * G, k1 = std::min(K, k0 + G);
      float amax = 0.f, sum = 0.f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(x[m * K + k])), sum += x[m * K + k];
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      for (int64_t k = k0; k < k1; ++k)
        rows.q[m * Kp + pair_slot(k)] = static_cast<int16_t>(std::nearbyint(x[m * K + k] * inv));
      rows.d[m * groups + g] = amax / 32767.f;
      rows.sum[m * groups + g] = sum;
    }
  }
  return rows;
}

// y[m, n] for the R activation rows from m0 and the NB outputs from n0 (constants, so that the sums
// stay in registers).
template <int NB, int R>
void dot_block(const int32_t* words, const float* scale, const float* lo, const Rows& xs, int64_t m0, int64_t n0,
               int64_t K, float* y, int64_t N) {
  const int64_t groups = K / G, tiles = K / TILE, stride = K / 8;
  float out[NB][R];
  const float* d[R];
  for (int r = 0; r < R; ++r) d[r] = xs.d.data() + (m0 + r) * groups;
#if defined(__AVX2__)
  const int16_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = xs.q.data() + (m0 + r) * K;
  const __m256i low = _mm256_set1_epi32(0x000F000F);
  __m256 total[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) total[b][r] = _mm256_setzero_ps();
  for (int64_t t = 0; t < tiles; ++t) {
    __m256i w[NB], acc[NB][R][2];
    for (int b = 0; b < NB; ++b) {
      // the next block's tile: decode's weights stream from L3 or memory, once per step (past the
      // last row this touches nothing: prefetches do not fault)
      _mm_prefetch(reinterpret_cast<const char*>(words + (n0 + NB + b) * stride + t * WORDS), _MM_HINT_T0);
      w[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + (n0 + b) * stride + t * WORDS));
    }
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      __m256i x[R];
      for (int r = 0; r < R; ++r) x[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + t * TILE + 16 * q));
      for (int b = 0; b < NB; ++b) {
        const __m256i codes = _mm256_and_si256(q == 0 ? w[b] : _mm256_srli_epi32(w[b], 4 * q), low);
        for (int r = 0; r < R; ++r) {
          const __m256i p = _mm256_madd_epi16(codes, x[r]);
          acc[b][r][q / 2] = q % 2 == 0 ? p : _mm256_add_epi32(acc[b][r][q / 2], p);
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const float* s = scale + (n0 + b) * groups + 2 * t;
      for (int r = 0; r < R; ++r) {
        const __m256 s0 = _mm256_set1_ps(s[0] * d[r][2 * t]), s1 = _mm256_set1_ps(s[1] * d[r][2 * t + 1]);
        total[b][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[b][r][0]), s0, total[b][r]);
        total[b][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[b][r][1]), s1, total[b][r]);
      }
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) out[b][r] = shardline::hsum(total[b][r]);
#else
  for (int b = 0; b < NB; ++b) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(words + (n0 + b) * stride);
    for (int r = 0; r < R; ++r) {
      const int16_t* xq = xs.q.data() + (m0 + r) * K;
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t dot = 0;
        for (int64_t k = g * G; k < (g + 1) * G; ++k) {
          const int64_t t = k / TILE, q = (k % TILE) / 16, j = k % 8, high = (k % 16) / 8;
          dot += static_cast<int32_t>((row[t * WORDS + j] >> (4 * q + 16 * high)) & 0xF) * xq[pair_slot(k)];
        }
        acc += static_cast<float>(dot) * scale[(n0 + b) * groups + g] * d[r][g];
      }
      out[b][r] = acc;
    }
  }
#endif
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) {
      float low_terms = 0.f;
      const float* xsum = xs.sum.data() + (m0 + r) * groups;
      const float* l = lo + (n0 + b) * groups;
      for (int64_t g = 0; g < groups; ++g) low_terms += l[g] * xsum[g];
      y[(m0 + r) * N + n0 + b] = out[b][r] + low_terms;
    }
}

// Outputs [n0, n1) in blocks of NB, the last ones one at a time.
template <int NB, int R>
void dot_rows(const int32_t* words, const float* scale, const float* lo, const Rows& xs, int64_t m0, int64_t n0,
              int64_t n1, int64_t K, float* y, int64_t N) {
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) dot_block<NB, R>(words, scale, lo, xs, m0, n, K, y, N);
  for (; n < n1; ++n) dot_block<1, R>(words, scale, lo, xs, m0, n, K, y, N);
}

// A block shape per activation rows left (1 to ROW_BLOCK): NB * R * 2 sums in flight, enough
// independent chains to keep the units busy at one row.
using DotRows = void (*)(const int32_t*, const float*, const float*, const Rows&, int64_t, int64_t, int64_t, int64_t,
                         float*, int64_t);
constexpr DotRows DOT_ROWS[ROW_BLOCK + 1] = {nullptr, dot_rows<4, 1>, dot_rows<2, 2>, dot_rows<1, 3>, dot_rows<1, 4>};

// K: the padded input dimension (x's is padded as it is prepared).
at::Tensor direct(const at::Tensor& x, const int32_t* words, const float* scale, const float* lo, int64_t N, int64_t K) {
  const int64_t M = x.size(0);
  const Rows rows = prepare_rows(x.const_data_ptr<float>(), M, x.size(1), K);
  at::Tensor y = at::empty({M, N}, x.options());
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK)
      DOT_ROWS[std::min(ROW_BLOCK, M - m0)](words, scale, lo, rows, m0, n0, n1, K, out, N);
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
        const __m256i nibble = _mm256_set1_epi32(0xF);
#pragma GCC unroll 8
        for (int h = 0; h < 8; ++h) {  // weights 8h .. 8h+8: q = h / 2, the high half when h is odd
          const __m256 c = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4 * (h / 2) + 16 * (h % 2)), nibble));
          const int64_t g = n * groups + 2 * t + h / 4;
          _mm256_storeu_ps(out + t * TILE + 8 * h, _mm256_fmadd_ps(c, _mm256_set1_ps(scale[g]), _mm256_set1_ps(lo[g])));
        }
#else
        for (int64_t k = 0; k < TILE; ++k) {
          const int64_t q = k / 16, j = k % 8, high = (k % 16) / 8, g = n * groups + 2 * t + k / G;
          const uint32_t code = (static_cast<uint32_t>(row[t * WORDS + j]) >> (4 * q + 16 * high)) & 0xF;
          out[t * TILE + k] = lo[g] + scale[g] * static_cast<float>(code);
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
          for (int64_t q = 0; q < 4; ++q)
            for (int64_t high = 0; high < 2; ++high)
              word |= static_cast<uint32_t>(src[n * K + t * TILE + 16 * q + 8 * high + j] & 0xF) << (4 * q + 16 * high);
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
