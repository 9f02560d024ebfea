// One decoder layer of a decode step as one call (DecodeLayer::forward, decode_layer.h), so that a
// step costs one Python call per layer rather than some twenty operators each: at one stream on
// a 2-core EPYC, the operators' dispatch cost more than the layer's arithmetic.
//
// The layer is the model's Block: x + attention(norm(x)), then + mlp(norm(.)), with the
// attention of paged_decode.cpp. Its four linear layers arrive in parts (runs of output rows,
// one part but where a layer's GGUF types differ), each as the operands of the kernel it was
// loaded for (kernels/quantized.py), one of:
//   0: torch's int4 kernel                 [packed, scales_zeros]
//   1: torch's int4 kernel, 8 bits as two  [high packed, high scales_zeros, low packed, low scales_zeros]
//   2: Shardline's int8 kernel             [records], straight from the codes up to the layer's
//      `direct_rows`, through the GEMM above (in bf16 where the machine chose `bf16_gemm`)
//   3: Shardline's int4 kernel             the same; with [.., packed, scales_zeros] of torch's int4
//      kernel as well, that kernel above the layer's `torch_rows`
//   4: Shardline's int6 kernel             [records], as 2
//   5: Shardline's Q4_K kernel             as 3

#include "decode_layer.h"

//
// A mixture of experts' MLP routes each row to its top-k experts and runs each picked expert once
// on all of its rows (a decode batch shares experts), summing in ascending order of expert as
// shard/model.py's MoE does.

#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros_like.h>

#include <cstring>

namespace {

at::Tensor linear(const at::Tensor& x, at::TensorList w, int64_t kind, int64_t direct_rows, int64_t torch_rows,
                  bool bf16_gemm) {
  switch (kind) {
    case 0:
      return at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), w[0], 32, w[1]).to(at::kFloat);
    case 1: {
      const at::Tensor xb = x.to(at::kBFloat16);
      return at::_weight_int4pack_mm_for_cpu(xb, w[0], 32, w[1]).to(at::kFloat).add_(
          at::_weight_int4pack_mm_for_cpu(xb, w[2], 32, w[3]));
    }
    case 2:
      return shardline::int8_linear(x, w[0], direct_rows, bf16_gemm);
    case 3:
    case 5:
      if (w.size() == 3 && x.size(0) > torch_rows)
        return at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), w[1], 32, w[2]).to(at::kFloat);
      return (kind == 3 ? shardline::int4_linear : shardline::q4_k_linear)(x, w[0], direct_rows, bf16_gemm);
    case 4:
      return shardline::int6_linear(x, w[0], direct_rows, bf16_gemm);
  }
  TORCH_CHECK(false, "unknown linear kind ", kind);
}

at::Tensor normed(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor h = x.clone();
  shardline::rms_norm_rows(h.data_ptr<float>(), h.size(0), h.size(1), weight.const_data_ptr<float>(), eps);
  return h;
}

}  // namespace

namespace shardline {

DecodeLayer::DecodeLayer(at::Tensor attn_norm, at::Tensor mlp_norm, double eps, std::vector<at::Tensor> operands,
                         std::vector<int64_t> part_info, std::vector<int64_t> parts, bool bf16_gemm,
                         std::optional<at::Tensor> qkv_bias, std::optional<at::Tensor> q_norm,
                         std::optional<at::Tensor> k_norm, double qk_eps, int64_t heads, double scale,
                         std::optional<at::Tensor> router, int64_t top_k, bool norm_topk,
                         std::optional<at::Tensor> shared_gate, double residual_scale)
    : attn_norm_(std::move(attn_norm)), mlp_norm_(std::move(mlp_norm)), eps_(eps), bf16_gemm_(bf16_gemm),
      qkv_bias_(std::move(qkv_bias)), q_norm_(std::move(q_norm)), k_norm_(std::move(k_norm)), qk_eps_(qk_eps),
      heads_(heads), scale_(scale), router_(std::move(router)), shared_gate_(std::move(shared_gate)), top_k_(top_k),
      norm_topk_(norm_topk), residual_scale_(residual_scale) {
  const size_t mlps = router_ ? router_->size(0) + (shared_gate_ ? 1 : 0) : 1;
  TORCH_CHECK(parts.size() == 2 + 2 * mlps, "parts per linear layer: qkv, wo, then w13 and w2 per MLP");
  TORCH_CHECK(!router_ || (router_->dim() == 2 && router_->scalar_type() == at::kFloat && top_k_ > 0 &&
                           top_k_ <= router_->size(0)),
              "a router is [experts, hidden] float32, with 0 < top_k <= experts");
  size_t info = 0, operand = 0;
  for (int64_t n : parts) {
    std::vector<Part> linear;
    for (int64_t j = 0; j < n; ++j, info += 4) {
      TORCH_CHECK(info + 4 <= part_info.size() && operand + part_info[info + 3] <= operands.size(),
                  "part_info holds 4 values a part, and the parts' operands are all given");
      const auto first = operands.begin() + static_cast<int64_t>(operand);
      operand += part_info[info + 3];
      linear.push_back({part_info[info], part_info[info + 1], part_info[info + 2],
                        std::vector<at::Tensor>(first, first + part_info[info + 3])});
    }
    linears_.push_back(std::move(linear));
  }
  TORCH_CHECK(info == part_info.size() && operand == operands.size(), "parts, part_info and operands must agree");
}

at::Tensor DecodeLayer::linear(const at::Tensor& x, int64_t which) const {
  const std::vector<Part>& parts = linears_[which];
  if (parts.size() == 1)
    return ::linear(x, parts[0].operands, parts[0].kind, parts[0].direct_rows, parts[0].torch_rows, bf16_gemm_);
  std::vector<at::Tensor> outs;
  for (const Part& p : parts) outs.push_back(::linear(x, p.operands, p.kind, p.direct_rows, p.torch_rows, bf16_gemm_));
  return at::cat(outs, 1);
}

at::Tensor DecodeLayer::forward(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                                at::Tensor k_pages, at::Tensor v_pages, const at::Tensor& slots,
                                const at::Tensor& block_tables, const at::Tensor& context_lens) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be [tokens, hidden] float32");
  const at::Tensor x = x_in.contiguous();
  at::Tensor qkv = linear(normed(x, attn_norm_, eps_), 0);
  if (qkv_bias_) qkv.add_(*qkv_bias_);
  const at::Tensor attended = paged_decode(qkv, cos, sin, q_norm_, k_norm_, qk_eps_, k_pages, v_pages, slots,
                                           block_tables, context_lens, heads_, scale_);
  // x + out * residual_scale, as the Block computes it (a scale of 1 multiplies nothing)
  const auto residual = [this](at::Tensor out, const at::Tensor& x) {
    return (residual_scale_ == 1.0 ? out : out.mul_(residual_scale_)).add_(x);
  };
  const at::Tensor h = residual(linear(attended, 1), x);
  const at::Tensor n = normed(h, mlp_norm_, eps_);
  return residual(router_ ? experts(n) : mlp(n, 2), h);
}

const DecodeLayer::Part* DecodeLayer::direct(const std::vector<Part>& parts, int64_t rows) {
  if (parts.size() != 1) return nullptr;
  const Part& p = parts[0];
  const bool ours = p.kind >= 2 && p.kind <= 5 && rows <= p.direct_rows;
  const bool torch_above = (p.kind == 3 || p.kind == 5) && p.operands.size() == 3 && rows > p.torch_rows;
  return ours && !torch_above ? &p : nullptr;
}

at::Tensor DecodeLayer::mlp(const at::Tensor& x, int64_t w13) const {
  return linear(silu_mul(linear(x, w13)), w13 + 1);
}

at::Tensor DecodeLayer::experts(const at::Tensor& x) const {
  const int64_t rows = x.size(0), count = router_->size(0);
  auto [weights, picked] = at::topk(at::softmax(at::linear(x, *router_), -1), top_k_, -1);
  if (norm_topk_) weights.div_(weights.sum(-1, true));
  // each expert's rows and their weights, rows in ascending order (as a stable sort leaves them)
  std::vector<std::vector<int64_t>> rows_of(count);
  std::vector<std::vector<float>> weights_of(count);
  const auto pick = picked.accessor<int64_t, 2>();
  const auto weight = weights.accessor<float, 2>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < top_k_; ++k) {
      rows_of[pick[r][k]].push_back(r);
      weights_of[pick[r][k]].push_back(weight[r][k]);
    }
  // Rows are gathered and the weighted outputs added by plain loops: at 16 streams a layer runs
  // some 55 experts of 2-3 rows, and index_select, mul_ and index_add_ per expert cost a tenth
  // of the step.
  const int64_t width = x.size(1);
  const float* in = x.const_data_ptr<float>();
  const auto gather = [&](const std::vector<int64_t>& mine, float* to) {
    for (const int64_t r : mine) std::memcpy(to, in + r * width, width * sizeof(float)), to += width;
  };
  // The experts whose two layers take their rows straight from the codes, on the kernels of the
  // first such, run together: their rows gathered in order of expert, each layer one call
  // (interleaved::multiply says why). Any other expert runs alone.
  std::vector<at::Tensor> w13s, w2s;
  std::vector<int64_t> offsets{0}, grouped_at(count, -1);  // an expert's first row in `grouped`
  int64_t kinds[2] = {-1, -1};
  for (int64_t e = 0; e < count; ++e) {
    const int64_t n = static_cast<int64_t>(rows_of[e].size());
    const Part *w13 = n ? direct(linears_[2 + 2 * e], n) : nullptr, *w2 = n ? direct(linears_[3 + 2 * e], n) : nullptr;
    if (!w13 || !w2) continue;
    if (kinds[0] < 0) kinds[0] = w13->kind, kinds[1] = w2->kind;
    if (w13->kind != kinds[0] || w2->kind != kinds[1]) continue;
    grouped_at[e] = offsets.back();
    offsets.push_back(offsets.back() + n);
    w13s.push_back(w13->operands[0]), w2s.push_back(w2->operands[0]);
  }
  at::Tensor grouped;
  if (!w13s.empty()) {
    at::Tensor gathered = at::empty({offsets.back(), width}, x.options());
    for (int64_t e = 0; e < count; ++e)
      if (grouped_at[e] >= 0) gather(rows_of[e], gathered.data_ptr<float>() + grouped_at[e] * width);
    grouped = record_linears(silu_mul(record_linears(gathered, w13s, offsets)), w2s, offsets);
  }
  at::Tensor out = at::zeros_like(x);
  float* sum = out.data_ptr<float>();
  for (int64_t e = 0; e < count; ++e) {
    const std::vector<int64_t>& mine = rows_of[e];
    const int64_t n = static_cast<int64_t>(mine.size());
    if (n == 0) continue;
    at::Tensor alone;
    if (grouped_at[e] < 0) {
      at::Tensor gathered = x;  // every row, in order (a row takes an expert once): one stream's every expert
      if (n < rows) gathered = at::empty({n, width}, x.options()), gather(mine, gathered.data_ptr<float>());
      alone = mlp(gathered, 2 + 2 * e).contiguous();
    }
    const float* ys = grouped_at[e] >= 0 ? grouped.const_data_ptr<float>() + grouped_at[e] * width
                                         : alone.const_data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      const float w = weights_of[e][i];
      float* to = sum + mine[i] * width;
      const float* from = ys + i * width;
      for (int64_t j = 0; j < width; ++j) to[j] += w * from[j];
    }
  }
  if (shared_gate_)
    out.add_(mlp(x, 2 + 2 * count).mul_(at::sigmoid(at::linear(x, shared_gate_->view({1, -1})))));
  return out;
}

}  // namespace shardline
