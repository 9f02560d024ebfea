// Registers Shardline's CPU kernels as torch operators, shardline_native::* (implementations in
// int8_linear.cpp, int6_linear.cpp, int4_linear.cpp, paged_decode.cpp and token_mask.cpp; shapes for tracing in
// native.py), and the decode layer as a class, shardline_native.DecodeLayer (decode_layer.h).

#include "decode_layer.h"

#include <torch/library.h>

namespace {

// A layer's records of whichever kernel, told apart by their size.
at::Tensor record_rows(const at::Tensor& records, const at::Tensor& tokens) {
  TORCH_CHECK(records.dim() == 3, "records must be [N/8, K/32, record bytes]");
  switch (records.size(2)) {
    case 160:
    case 1184: return shardline::int4_rows(records, tokens);
    case 224: return shardline::int6_rows(records, tokens);
    case 288: return shardline::int8_rows(records, tokens);
  }
  TORCH_CHECK(false, "no kernel's records are ", records.size(2), " bytes");
}

}  // namespace

namespace shardline {

at::Tensor record_linears(const at::Tensor& x, at::TensorList records, at::IntArrayRef offsets) {
  TORCH_CHECK(!records.empty() && records[0].dim() == 3, "records must be [N/8, K/32, record bytes]");
  switch (records[0].size(2)) {
    case 160: return int4_linears(x, records, offsets);
    case 1184: return q4_k_linears(x, records, offsets);
    case 224: return int6_linears(x, records, offsets);
    case 288: return int8_linears(x, records, offsets);
  }
  TORCH_CHECK(false, "no kernel's records are ", records[0].size(2), " bytes");
}

}  // namespace shardline

TORCH_LIBRARY(shardline_native, m) {
  m.def("int8_pack(Tensor codes, Tensor scale, Tensor lo) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor records, int max_direct_rows, bool bf16_gemm) -> Tensor");
  m.def("int4_pack(Tensor codes, Tensor scale, Tensor lo) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor records, int max_direct_rows, bool bf16_gemm) -> Tensor");
  m.def("int6_pack(Tensor codes, Tensor sc, Tensor d) -> Tensor");
  m.def("int6_linear(Tensor x, Tensor records, int max_direct_rows, bool bf16_gemm) -> Tensor");
  m.def("record_rows(Tensor records, Tensor tokens) -> Tensor");
  m.def("record_linears(Tensor x, Tensor[] records, int[] offsets) -> Tensor");
  m.def("q4_k_pack(Tensor blocks) -> Tensor");
  m.def("q4_k_linear(Tensor x, Tensor records, int max_direct_rows, bool bf16_gemm) -> Tensor");
  m.def("q6_k_pack(Tensor blocks) -> Tensor");
  m.def("int4_groups(Tensor records) -> (Tensor, Tensor, Tensor)");
  m.def("paged_decode(Tensor qkv, Tensor cos, Tensor sin, Tensor? q_norm, Tensor? k_norm, float eps, "
        "Tensor(a!) k_pages, Tensor(b!) v_pages, Tensor slots, Tensor block_tables, Tensor context_lens, "
        "int heads, float scale) -> Tensor");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("mask_logits(Tensor logits, Tensor packed) -> Tensor");
  m.class_<shardline::DecodeLayer>("DecodeLayer")
      .def(torch::init<at::Tensor, at::Tensor, double, std::vector<at::Tensor>, std::vector<int64_t>,
                       std::vector<int64_t>, bool, std::optional<at::Tensor>, std::optional<at::Tensor>,
                       std::optional<at::Tensor>, double, int64_t, double, std::optional<at::Tensor>, int64_t, bool,
                       std::optional<at::Tensor>, double>())
      .def("forward", &shardline::DecodeLayer::forward);
}

TORCH_LIBRARY_IMPL(shardline_native, CPU, m) {
  m.impl("int8_pack", shardline::int8_pack);
  m.impl("int8_linear", shardline::int8_linear);
  m.impl("int4_pack", shardline::int4_pack);
  m.impl("int4_linear", shardline::int4_linear);
  m.impl("int6_pack", shardline::int6_pack);
  m.impl("int6_linear", shardline::int6_linear);
  m.impl("record_rows", record_rows);
  m.impl("record_linears", shardline::record_linears);
  m.impl("q4_k_pack", shardline::q4_k_pack);
  m.impl("q4_k_linear", shardline::q4_k_linear);
  m.impl("q6_k_pack", shardline::q6_k_pack);
  m.impl("int4_groups", shardline::int4_groups);
  m.impl("paged_decode", shardline::paged_decode);
  m.impl("silu_mul", shardline::silu_mul);
  m.impl("mask_logits", shardline::mask_logits);
}
