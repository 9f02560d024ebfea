// Shardline's 8-bit linear kernel (shardline_native::int8_linear): LM heads, and the layers that
// a GGUF holds in more than 4 bits.
//
// Weights are groups of 32 along the input dimension, w = lo + scale * code, with codes as int8
// (the 0..254 grid shifted per group, the shift folded into lo: kernels/operands.py) and scale and
// lo in fp16. As in
// int4_linear.cpp, eight output rows are interleaved across the vector lanes: for each block of 8
// outputs and each pair of weights (2p, 2p + 1), 16 bytes, output 8b + i's two codes at 2i and
// 2i + 1, in records of a block's group (`int8_pack`, interleaved.h). So one load sign-extended to
// int16 is, per lane, the pair of codes of one output that multiplies activations 2p and 2p + 1,
// which one broadcast serves for all 8 outputs, and a group's scales and los are one load per 8
// outputs.
//
// The activations are quantized to int16 per group of 32 as for the 4-bit kernel
// (shardline::int16_rows; a pair of |code| <= 128 times |xq| <= 32767 is one exact vpmaddwd, and a
// group's 16 pairs sum below 2^28). (It multiplied int8 activations as llama.cpp's Q8_0 does, one
// output per vector: per group and row the scale work of a conversion, an FMA and a broadcast cost
// as much as the integer products; interleaved, a 16-row step of SmolLM2's LM head is 2-3x faster.)

#include "interleaved.h"

#include <cstdint>

namespace {

using shardline::interleaved::B;
using shardline::interleaved::G;

// A record's codes, as the shared direct path reads them (interleaved.h): per pair of weights,
// 16 bytes, output i's two codes at 2i and 2i + 1.
struct Int8Codes : shardline::interleaved::GroupScales<G * B> {
  static const int8_t* codes(const char* rec) { return reinterpret_cast<const int8_t*>(rec); }

#if defined(__AVX2__)
  static constexpr int PAIRS = 1;  // a load is 16 bytes, sign-extended: one pair per lane
  static __m256i load(const char* rec, int l) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes(rec) + 2 * l * B)));
  }
  static __m256i pairs(__m256i w, int) { return w; }
#if defined(SHARDLINE_WIDE)
  static __m512i pairs(__m512i w, int) { return w; }
#endif
#endif
  // where output i's code for weight k of the group lies among the record's codes
  static int64_t position(int64_t i, int64_t k) { return (k - k % 2) * B + 2 * i + k % 2; }
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
