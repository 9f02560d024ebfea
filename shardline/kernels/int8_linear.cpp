// Shardline's 8-bit linear kernel (shardline_native::int8_linear): LM heads, and the layers that
// a GGUF holds in more than 4 bits.
//
// Weights are groups of 32 along the input dimension, w = lo + scale * code, with codes as int8
// (the 0..254 grid shifted per group, the shift folded into lo: kernels/operands.py) and scale and
// lo in fp16. As in int4_linear.cpp, eight output rows are interleaved across the vector lanes:
// for each block of 8 outputs and each quad of the group (4 weights in the activations' lane
// order, interleaved.h), 32 bytes, output 8b + i's four codes at 4i .. 4i + 3, in records of a
// block's group (`int8_pack`). So one load is, per lane, the quad of codes of one output that
// multiplies 4 activations, which one broadcast serves for all 8 outputs, and a group's scales
// and los are one load per 8 outputs.
//
// The activations are int8 per group of 32 as for the 4-bit kernel (shardline::int8_activations).
// The codes are signed: VNNI multiplies them as unsigned bytes 128 higher (less 128 times the
// activations' sum), AVX2 as their magnitudes times the activations of their signs. (It
// multiplied int8 activations as llama.cpp's Q8_0 does, one output per vector: per group and row
// the scale work of a conversion, an FMA and a broadcast cost as much as the integer products;
// interleaved, a 16-row step of SmolLM2's LM head is 2-3x faster.)

#include "interleaved.h"

#include <cstdint>

namespace {

using shardline::interleaved::B;
using shardline::interleaved::G;

// A record's codes, as the shared direct path reads them (interleaved.h): per quad, 32 bytes,
// output i's four codes at 4i .. 4i + 3.
struct Int8Codes : shardline::interleaved::GroupScales<G * B> {
  static constexpr int OFFSET = 0;
  static constexpr bool SIGNED = true;
  static const int8_t* codes(const char* rec) { return reinterpret_cast<const int8_t*>(rec); }

#if defined(__AVX2__)
  static constexpr int QUADS = 1;  // a load is 32 bytes: one quad per lane
  static __m256i load(const char* rec, int l) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes(rec) + 4 * l * B));
  }
  static __m256i quads(__m256i w, int, int) { return w; }
#if defined(SHARDLINE_WIDE)
  static __m512i quads(__m512i w, int, int) { return w; }
#endif
#endif
  // where output i's code for weight k of the group lies among the record's codes
  static int64_t position(int64_t i, int64_t k) {
    const int64_t p = shardline::interleaved::lane_position(k);
    return p / 4 * 4 * B + 4 * i + p % 4;
  }
  static int32_t at(const char* rec, int64_t i, int64_t k) { return codes(rec)[position(i, k)]; }
};

}  // namespace

namespace shardline {

at::Tensor int8_pack(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& lo) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.size(0) % B == 0 && codes.size(1) % G == 0,
              "codes must be [N, K] int8 with N a multiple of ", B, " and K of ", G);
  const at::Tensor c = codes.contiguous();
  const int64_t K = c.size(1);
  const int8_t* src = c.const_data_ptr<int8_t>();
  return interleaved::pack<Int8Codes>(scale, lo, c.size(0), K, [&](char* rec, int64_t b, int64_t g) {
    int8_t* dst = reinterpret_cast<int8_t*>(rec);
    for (int64_t k = 0; k < G; ++k)
      for (int64_t i = 0; i < B; ++i) dst[Int8Codes::position(i, k)] = src[(b * B + i) * K + g * G + k];
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& records, int64_t max_direct_rows, bool bf16_gemm) {
  return interleaved::linear<Int8Codes>(x, records, max_direct_rows, bf16_gemm);
}

at::Tensor int8_linears(const at::Tensor& x, at::TensorList records, at::IntArrayRef offsets) {
  return interleaved::multiply<Int8Codes>(records, x, offsets);
}

at::Tensor int8_rows(const at::Tensor& records, const at::Tensor& tokens) {
  return interleaved::weight_rows<Int8Codes>(records, tokens);
}

}  // namespace shardline
