// A decoder layer's decode steps as an object (torch.classes.shardline_native.DecodeLayer, made
// once per layer by shard/transforms.py) that holds what does not change between steps: the
// layer's weights, norms and kernel choices. A step passes only its own tensors; as an operator
// of ~25 arguments, parsing them cost more per layer and step than the layer's attention.
// (Its own header: torch's custom-class header is heavy, and only the layer and the
// registration need it.)
#pragma once

#include "native.h"

#include <torch/custom_class.h>

namespace shardline {

class DecodeLayer : public torch::CustomClassHolder {
 public:
  // The linear layers (qkv, wo, then the MLP's w13 and w2) as parts, each a run of output rows on
  // one kernel (a fused QKV of mixed GGUF types has two): `parts` per linear layer, and per part
  // its kind, direct_rows, torch_rows and how many of `operands` are its own (decode_layer.cpp).
  // A mixture of experts (`router` [experts, hidden] fp32) has w13 and w2 per expert in place of
  // the MLP's, then the shared expert's where `shared_gate` [hidden] is given; each row takes its
  // `top_k` experts, their softmax weights renormalized where `norm_topk`. Attention's and the
  // MLP's outputs are scaled by `residual_scale` before each residual add (Granite's multiplier).
  DecodeLayer(at::Tensor attn_norm, at::Tensor mlp_norm, double eps, std::vector<at::Tensor> operands,
              std::vector<int64_t> part_info, std::vector<int64_t> parts, bool bf16_gemm,
              std::optional<at::Tensor> qkv_bias, std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
              double qk_eps, int64_t heads, double scale, std::optional<at::Tensor> router, int64_t top_k,
              bool norm_topk, std::optional<at::Tensor> shared_gate, double residual_scale);
  // x [rows, hidden] -> the layer's output [rows, hidden]; writes each row's K/V at its slot.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_pages,
                     at::Tensor v_pages, const at::Tensor& slots, const at::Tensor& block_tables,
                     const at::Tensor& context_lens);

 private:
  struct Part {
    int64_t kind, direct_rows, torch_rows;
    std::vector<at::Tensor> operands;  // decode_layer.cpp says which, by kind
  };
  // The part of a linear layer that multiplies `rows` rows straight from its records (its only
  // part, on one of Shardline's kernels, at most its direct_rows and torch_rows), or nullptr.
  static const Part* direct(const std::vector<Part>& parts, int64_t rows);
  at::Tensor linear(const at::Tensor& x, int64_t which) const;
  at::Tensor mlp(const at::Tensor& x, int64_t w13) const;  // the MLP whose w13 is linear `w13`, w2 the next
  at::Tensor experts(const at::Tensor& x) const;

  at::Tensor attn_norm_, mlp_norm_;
  double eps_;
  std::vector<std::vector<Part>> linears_;  // qkv, wo, w13, w2
  bool bf16_gemm_;
  std::optional<at::Tensor> qkv_bias_, q_norm_, k_norm_;
  double qk_eps_;
  int64_t heads_;
  double scale_;
  std::optional<at::Tensor> router_, shared_gate_;
  int64_t top_k_;
  bool norm_topk_;
  double residual_scale_;
};

}  // namespace shardline
