// Shardline's CPU kernels (int8_linear.cpp, int4_linear.cpp, paged_decode.cpp), shared by their operators (native.cpp)
// and the fused decoder layer (decode_layer.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <optional>
#include <tuple>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace shardline {

// codes [N, K] int8 (N a multiple of 8, K of 32), scale and lo [N, K/32] -> int8_linear's records
// [N/8, K/32, 288] uint8, 8 outputs interleaved (int8_linear.cpp, interleaved.h).
at::Tensor int8_pack(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& lo);

// x [M, K] fp32 times the weights lo + scale * code that int8_pack's records hold -> [M, N]: up to
// `max_direct_rows` rows straight from the codes, more through a GEMM (in bf16 where `bf16_gemm`).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& records, int64_t max_direct_rows, bool bf16_gemm);

// codes [N, K] 0..63 (N a multiple of 8, K of 32), Q6_K's int8 scales sc [N, K/16] and d [N, K/32]
// (its super-block's, per group) -> int6_linear's records [N/8, K/32, 224] uint8 (int6_linear.cpp).
at::Tensor int6_pack(const at::Tensor& codes, const at::Tensor& sc, const at::Tensor& d);

// GGUF's Q4_K blocks [N, K/256 * 144] uint8 -> q4_k_linear's records [N/8, K/256, 1184] (N padded
// to whole blocks of 8); Q6_K's [N, K/256 * 210] -> int6_linear's records.
at::Tensor q4_k_pack(const at::Tensor& blocks);
at::Tensor q6_k_pack(const at::Tensor& blocks);

// x [M, K] fp32 times the weights q4_k_pack's records hold, as int4_linear.
at::Tensor q4_k_linear(const at::Tensor& x, const at::Tensor& records, int64_t max_direct_rows, bool bf16_gemm);

// int4_pack's or q4_k_pack's records -> the groups they hold: (codes uint8 [N, K], scale and lo
// fp32 [N, K/32]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_groups(const at::Tensor& records);

// The same for int6_pack's records, w = d * sc * (code - 32).
at::Tensor int6_linear(const at::Tensor& x, const at::Tensor& records, int64_t max_direct_rows, bool bf16_gemm);

// Several layers of one shape in the records of one kernel at once, straight from their codes:
// layer e (records[e]) times x's rows [offsets[e], offsets[e + 1]) into the same rows of the
// [M, N] result (a mixture's experts on their rows, sorted by expert; interleaved::multiply).
at::Tensor int8_linears(const at::Tensor& x, at::TensorList records, at::IntArrayRef offsets);
at::Tensor int6_linears(const at::Tensor& x, at::TensorList records, at::IntArrayRef offsets);
at::Tensor int4_linears(const at::Tensor& x, at::TensorList records, at::IntArrayRef offsets);
at::Tensor q4_k_linears(const at::Tensor& x, at::TensorList records, at::IntArrayRef offsets);
// The same for records of any of the kernels, told apart by their size (native.cpp).
at::Tensor record_linears(const at::Tensor& x, at::TensorList records, at::IntArrayRef offsets);

// The weight rows `tokens` of a layer held in records of any of the kernels, fp32 [T, K]
// (a tied embedding's lookups).
at::Tensor int4_rows(const at::Tensor& records, const at::Tensor& tokens);
at::Tensor int6_rows(const at::Tensor& records, const at::Tensor& tokens);
at::Tensor int8_rows(const at::Tensor& records, const at::Tensor& tokens);

// Rows of activations quantized to int8 per group of 32 (x ~= d * q, |q| <= 127, rounded to
// nearest), each group's values in the direct path's lane order (interleaved.h, LANE_ORDER).
struct Int8Rows {
  std::vector<int8_t> q;        // [M, K]
  std::vector<float> d;         // [M, K/32] each group's scale
  std::vector<float> lo_sum;    // [M, K/32] d times the sum of the group's q (for the lo terms)
  std::vector<int32_t> sum16;   // [M, K/16] the sum of q over each half group (for codes' offsets)
};
Int8Rows int8_activations(const float* x, int64_t M, int64_t K);

// codes [N, K] 0..15 (N a multiple of 8, K of 32), scale and lo [N, K/32] -> int4_linear's records
// [N/8, K/32, 160] uint8, 8 outputs interleaved (int4_linear.cpp, interleaved.h).
at::Tensor int4_pack(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& lo);

// The same for int4_pack's records.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& records, int64_t max_direct_rows, bool bf16_gemm);

at::Tensor paged_decode(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                        const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                        double eps, at::Tensor k_pages, at::Tensor v_pages, const at::Tensor& slots,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t heads,
                        double softmax_scale);

at::Tensor silu_mul(const at::Tensor& x);

// logits [rows, vocab] with -inf wherever the packed mask [rows, 4 x words] has a clear bit.
at::Tensor mask_logits(const at::Tensor& logits, const at::Tensor& packed);

// Each of `rows` rows of n floats, in place: x * rsqrt(mean(x^2) + eps) * w.
void rms_norm_rows(float* x, int64_t rows, int64_t n, const float* w, double eps);

#if defined(__AVX2__)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// 8 fp16 values at a and 8 at b as 16 fp32.
inline __m512 load_half16(const c10::Half* a, const c10::Half* b) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}
#endif

// 8 fp16 values as fp32 (F16C: every AVX2 CPU has it, and x86-64-v3 includes it).
inline __m256 load_half8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The sum, or the largest, of a vector's 8 floats.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace shardline
