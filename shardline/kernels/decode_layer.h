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
  DecodeLayer(at::Tensor attn_norm, at::Tensor mlp_norm, double eps, std::vector<at::Tensor> qkv,
              std::vector<at::Tensor> wo, std::vector<at::Tensor> w13, std::vector<at::Tensor> w2,
              std::vector<int64_t> kinds, std::vector<int64_t> direct_rows, std::vector<int64_t> torch_rows,
              bool bf16_gemm, std::optional<at::Tensor> qkv_bias, std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
              double qk_eps, int64_t heads, double scale);
  // x [rows, hidden] -> the layer's output [rows, hidden]; writes each row's K/V at its slot.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_pages,
                     at::Tensor v_pages, const at::Tensor& slots, const at::Tensor& block_tables,
                     const at::Tensor& context_lens);

 private:
  at::Tensor attn_norm_, mlp_norm_;
  double eps_;
  std::vector<at::Tensor> qkv_, wo_, w13_, w2_;  // each linear's operands (decode_layer.cpp: by kind)
  std::vector<int64_t> kinds_, direct_rows_, torch_rows_;
  bool bf16_gemm_;
  std::optional<at::Tensor> qkv_bias_, q_norm_, k_norm_;
  double qk_eps_;
  int64_t heads_;
  double scale_;
};

}  // namespace shardline
