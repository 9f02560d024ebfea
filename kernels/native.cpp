// Registers Shardline's CPU kernels as torch operators, shardline_native::* (implementations in
// int8_linear.cpp, int4_linear.cpp, paged_decode.cpp, decode_layer.cpp and token_mask.cpp; shapes for tracing in native.py).

#include "native.h"

#include <torch/library.h>

TORCH_LIBRARY(shardline_native, m) {
  m.def("int8_pack(Tensor codes, Tensor scale, Tensor lo) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor records) -> Tensor");
  m.def("int4_pack(Tensor codes, Tensor scale, Tensor lo) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor records, int max_direct_rows) -> Tensor");
  m.def("paged_decode(Tensor qkv, Tensor cos, Tensor sin, Tensor? q_norm, Tensor? k_norm, float eps, "
        "Tensor(a!) k_pages, Tensor(b!) v_pages, Tensor slots, Tensor block_tables, Tensor context_lens, "
        "int heads, float scale) -> Tensor");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("mask_logits(Tensor logits, Tensor packed) -> Tensor");
  m.def("decode_layer(Tensor x, Tensor attn_norm, Tensor mlp_norm, float eps, Tensor[] qkv, Tensor[] wo, "
        "Tensor[] w13, Tensor[] w2, int[] kinds, int[] direct_rows, int[] torch_rows, Tensor? qkv_bias, Tensor cos, "
        "Tensor sin, Tensor? q_norm, Tensor? k_norm, float qk_eps, Tensor(a!) k_pages, Tensor(b!) v_pages, "
        "Tensor slots, Tensor block_tables, Tensor context_lens, int heads, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(shardline_native, CPU, m) {
  m.impl("int8_pack", shardline::int8_pack);
  m.impl("int8_linear", shardline::int8_linear);
  m.impl("int4_pack", shardline::int4_pack);
  m.impl("int4_linear", shardline::int4_linear);
  m.impl("paged_decode", shardline::paged_decode);
  m.impl("silu_mul", shardline::silu_mul);
  m.impl("mask_logits", shardline::mask_logits);
  m.impl("decode_layer", shardline::decode_layer);
}
