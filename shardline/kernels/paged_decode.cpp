// Decode attention over the paged KV cache (shardline_native::paged_decode) and the MLP's
// silu-and-multiply (shardline_native::silu_mul).
//
// Decode attention reads the paged K/V cache [pages, page_size, kv_heads, head_dim] through each
// sequence's block table, after normalizing and rotating q and k and writing the new K/V. The
// pages may be fp32, fp16 or bf16 (--kv-dtype); everything is computed in fp32.

#include "native.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

void rms_norm_inplace(float* v, int64_t n, const float* w, double eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += v[i] * v[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) v[i] = v[i] * inv * w[i];
}

// x[i] * cos[i] + roll(x, half)[i] * sin'[i] (sin' has its first half negated): rotate-half RoPE.
void rotate(float* x, int64_t d, const float* cos, const float* sin) {
  float tmp[512];
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) tmp[i] = x[i] * cos[i] + x[i + half] * sin[i];
  for (int64_t i = half; i < d; ++i) tmp[i] = x[i] * cos[i] + x[i - half] * sin[i];
  std::copy(tmp, tmp + d, x);
}

}  // namespace

namespace shardline {

void rms_norm_rows(float* x, int64_t rows, int64_t n, const float* w, double eps) {
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_inplace(x + r * n, n, w, eps);
  });
}

}  // namespace shardline

namespace {

// Cached K/V rows may be narrower than fp32 (--kv-dtype): widened into a buffer to compute on.
template <typename T>
inline const float* widen(const T* src, int64_t d, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
#if defined(__F16C__)
    if constexpr (std::is_same_v<T, c10::Half>) {
      for (int64_t j = 0; j < d; j += 8)
        _mm256_storeu_ps(buf + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))));
      return buf;
    }
#endif
    for (int64_t j = 0; j < d; ++j) buf[j] = static_cast<float>(src[j]);
    return buf;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// q . k for four keys at once: four independent FMA chains (one would wait on FMA latency).
inline void dot4(const float* q, const float* const* k, int64_t d, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (int64_t j = 0; j < d; j += 8) {
    const __m256 qv = _mm256_loadu_ps(q + j);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + j), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + j), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + j), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + j), a3);
  }
  // the four sums at once: pairwise adds within the 128-bit halves, then the halves added
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Eight cached values as fp32 (fp32 pages as they are, fp16 ones widened).
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// acc[0, d) = sum over the tokens of p[t] * (v[t] + off)[0, d), 64 values at a time in registers
// (the tokens' rows read straight from the pages: no widened copy, no accumulator in memory).
template <typename T>
void weigh_values(const float* p, const T* const* v, int64_t off, int64_t cnt, int64_t d, float* acc) {
  for (int64_t d0 = 0; d0 < d; d0 += 64) {
    const int64_t n8 = std::min<int64_t>(8, (d - d0) / 8);
    __m256 a[8];
    for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
    if (n8 == 8) {
      for (int64_t t = 0; t < cnt; ++t) {
        const __m256 pt = _mm256_set1_ps(p[t]);
        const T* vt = v[t] + off + d0;
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(pt, load8(vt + 8 * j), a[j]);
      }
    } else {
      for (int64_t t = 0; t < cnt; ++t) {
        const __m256 pt = _mm256_set1_ps(p[t]);
        for (int64_t j = 0; j < n8; ++j) a[j] = _mm256_fmadd_ps(pt, load8(v[t] + off + d0 + 8 * j), a[j]);
      }
    }
    for (int64_t j = 0; j < n8; ++j) _mm256_storeu_ps(acc + d0 + 8 * j, a[j]);
  }
}
#endif

// Attention of each sequence's q heads over its cached context, read token by token: a cached
// token's K (or V) for all KV heads is one contiguous row, and a page is a contiguous run of
// them, which the hardware prefetcher streams (reading one KV head's slice per pass did not).
// Each context splits into as many runs of pages as there are threads, whose partial results
// merge by their softmax maxima and sums (as flash-decoding does), so that one sequence keeps
// every thread busy. The split depends on nothing but the context's length: a row's attention
// is the same number whatever else its step computes (a greedy token at a near-tie must not
// change where a step verifies proposals, or decodes beside other sequences).
template <typename T>
void attend(const float* q, int64_t width, int64_t B, int64_t heads, int64_t kv_heads, int64_t d, const T* kc,
            const T* vc, int64_t page_size, const int64_t* tb, int64_t pages_per_row, const int64_t* ln,
            float softmax_scale, float* o) {
  const int64_t group = heads / kv_heads, row_len = kv_heads * d;
  const int64_t threads = at::get_num_threads();
  const int64_t splits = threads;
  std::vector<float> part_max(B * splits * heads), part_sum(B * splits * heads, 0.f),
      part_acc(B * splits * heads * d, 0.f);
  at::parallel_for(0, B * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, rows(4 * row_len);
    std::vector<const T*> values;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / splits, split = i % splits, n = ln[b], pages = (n + page_size - 1) / page_size;
      const int64_t first = split * pages / splits * page_size, last = std::min(n, (split + 1) * pages / splits * page_size);
      if (last <= first) continue;  // part_sum stays 0: the merge skips this part
      const int64_t cnt = last - first;
      const float* qb = q + b * width;
      const int64_t* table = tb + b * pages_per_row;
      auto token = [&](const T* cache, int64_t t, float* buf) {
        return widen(cache + (table[t / page_size] * page_size + t % page_size) * row_len, row_len, buf);
      };
      scores.resize(heads * cnt);
      int64_t t = first;
#if defined(__AVX2__) && defined(__FMA__)
      for (; t + 4 <= last; t += 4) {
        const float* r[4];
        for (int j = 0; j < 4; ++j) r[j] = token(kc, t + j, rows.data() + j * row_len);
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t off = (h / group) * d;
          const float* k[4] = {r[0] + off, r[1] + off, r[2] + off, r[3] + off};
          dot4(qb + h * d, k, d, scores.data() + h * cnt + (t - first));
        }
      }
#endif
      for (; t < last; ++t) {
        const float* r = token(kc, t, rows.data());
        for (int64_t h = 0; h < heads; ++h) {
          const float* k = r + (h / group) * d;
          float s = 0.f;
          for (int64_t j = 0; j < d; ++j) s += qb[h * d + j] * k[j];
          scores[h * cnt + (t - first)] = s;
        }
      }
      const int64_t part = (b * splits + split) * heads;
      for (int64_t h = 0; h < heads; ++h) {
        float* sh = scores.data() + h * cnt;
        float m = sh[0];
        for (int64_t j = 0; j < cnt; ++j) m = std::max(m, sh[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < cnt; ++j) sum += (sh[j] = std::exp((sh[j] - m) * softmax_scale));
        part_max[part + h] = m * softmax_scale;
        part_sum[part + h] = sum;
      }
      float* acc = part_acc.data() + part * d;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::Half>) {
        // per head, over the tokens' rows (located once): each head's sums stay in registers
        values.resize(cnt);
        for (t = first; t < last; ++t) values[t - first] = vc + (table[t / page_size] * page_size + t % page_size) * row_len;
        for (int64_t h = 0; h < heads; ++h)
          weigh_values(scores.data() + h * cnt, values.data(), (h / group) * d, cnt, d, acc + h * d);
        continue;
      }
#endif
      for (t = first; t < last; ++t) {
        const float* r = token(vc, t, rows.data());
        for (int64_t h = 0; h < heads; ++h) {
          const float p = scores[h * cnt + (t - first)];
          const float* v = r + (h / group) * d;
          float* ah = acc + h * d;
          for (int64_t j = 0; j < d; ++j) ah[j] += p * v[j];
        }
      }
    }
  });
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      float m = -std::numeric_limits<float>::max();
      for (int64_t sp = 0; sp < splits; ++sp) {
        const int64_t part = (b * splits + sp) * heads + h;
        if (part_sum[part] > 0.f) m = std::max(m, part_max[part]);
      }
      float total = 0.f;
      float* oh = o + (b * heads + h) * d;
      std::fill(oh, oh + d, 0.f);
      for (int64_t sp = 0; sp < splits; ++sp) {
        const int64_t part = (b * splits + sp) * heads + h;
        if (part_sum[part] == 0.f) continue;
        const float w = std::exp(part_max[part] - m);
        total += w * part_sum[part];
        const float* acc = part_acc.data() + part * d;
        for (int64_t j = 0; j < d; ++j) oh[j] += w * acc[j];
      }
      for (int64_t j = 0; j < d; ++j) oh[j] /= total;
    }
  }
}

template <typename T>
void write_rows(const float* src, int64_t d, T* dst) {
  for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<T>(src[j]);  // rounds to nearest even, as torch does
}

}  // namespace

namespace shardline {

// qkv [B, (heads + 2 kv_heads) * head_dim] of a decode step (one new token per sequence) ->
// attention output [B, heads * head_dim]. Normalizes q and k per head when q_norm/k_norm are
// given, rotates them, writes k and v into `slots` (in the pages' dtype: float32, float16 or
// bfloat16), then attends over each sequence's context.
at::Tensor paged_decode(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                        const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                        double eps, at::Tensor k_pages, at::Tensor v_pages, const at::Tensor& slots_in,
                        const at::Tensor& block_tables_in, const at::Tensor& context_lens_in, int64_t heads,
                        double softmax_scale) {
  TORCH_CHECK(k_pages.is_contiguous() && v_pages.is_contiguous() && k_pages.scalar_type() == v_pages.scalar_type(),
              "KV pages must be contiguous, K and V of one dtype");
  const int64_t page_size = k_pages.size(1), kv_heads = k_pages.size(2), d = k_pages.size(3);
  TORCH_CHECK(d <= 512 && d % 8 == 0, "head_dim must be a multiple of 8, at most 512");
  at::Tensor qkv = qkv_in.clone(at::MemoryFormat::Contiguous);  // normalized and rotated in place
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  const at::Tensor tables = block_tables_in.to(at::kLong).contiguous();
  const at::Tensor lens = context_lens_in.to(at::kLong).contiguous();
  const int64_t B = qkv.size(0), width = qkv.size(1), pages_per_row = tables.size(1);
  TORCH_CHECK(width == (heads + 2 * kv_heads) * d, "qkv width disagrees with the heads");
  float* q = qkv.data_ptr<float>();
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();
  const float* qn = q_norm ? q_norm->const_data_ptr<float>() : nullptr;
  const float* kn = k_norm ? k_norm->const_data_ptr<float>() : nullptr;
  const int64_t* sl = slots.const_data_ptr<int64_t>();
  const int64_t token_stride = kv_heads * d;

  at::Tensor out = at::empty({B, heads * d}, qkv.options());
  if (B == 0) return out;  // (attend splits the contexts per sequence)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_pages.scalar_type(), "paged_decode", [&] {
    scalar_t* kc = k_pages.data_ptr<scalar_t>();
    scalar_t* vc = v_pages.data_ptr<scalar_t>();
    for (int64_t b = 0; b < B; ++b) {
      float* row = q + b * width;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        float* v = row + h * d;
        if (h < heads && qn) rms_norm_inplace(v, d, qn, eps);
        if (h >= heads && kn) rms_norm_inplace(v, d, kn, eps);
        rotate(v, d, cp + b * d, sp + b * d);
      }
      write_rows(row + heads * d, kv_heads * d, kc + sl[b] * token_stride);
      write_rows(row + (heads + kv_heads) * d, kv_heads * d, vc + sl[b] * token_stride);
    }
    attend(q, width, B, heads, kv_heads, d, kc, vc, page_size, tables.const_data_ptr<int64_t>(), pages_per_row,
           lens.const_data_ptr<int64_t>(), static_cast<float>(softmax_scale), out.data_ptr<float>());
  });
  return out;
}

// silu(gate) * up of [rows, 2 * I] whose first I columns are the gate: -> [rows, I].
at::Tensor silu_mul(const at::Tensor& x_in) {
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), I = x.size(1) / 2;
  at::Tensor y = at::empty({M, I}, x.options());
  const float* p = x.const_data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < I; ++i) {
        const float g = p[r * 2 * I + i];
        // exp capped below fp32's overflow: built with -ffast-math, g / inf is not the 0 it should be
        out[r * I + i] = g / (1.f + std::exp(std::min(-g, 88.f))) * p[r * 2 * I + I + i];
      }
  });
  return y;
}

}  // namespace shardline
