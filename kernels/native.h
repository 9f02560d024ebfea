// Shardline's CPU kernels, shared by the operators in native.cpp and the fused layer in decode_layer.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace shardline {

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const at::Tensor& lo, int64_t bits);

at::Tensor paged_decode(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                        const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                        double eps, at::Tensor k_pages, at::Tensor v_pages, const at::Tensor& slots,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t heads,
                        double softmax_scale);

at::Tensor silu_mul(const at::Tensor& x);

// Each of `rows` rows of n floats, in place: x * rsqrt(mean(x^2) + eps) * w.
void rms_norm_rows(float* x, int64_t rows, int64_t n, const float* w, double eps);

}  // namespace shardline
