// Shardline's 8-bit linear kernel (shardline_native::int8_linear), in practice the LM head.
//
// Weights are groups of 32 along the input dimension, w = lo + scale * code, with codes as int8
// -128..126 (lo includes the +128 shift from the 0..254 grid) and scale and lo in fp32. As in
// int4_linear.cpp, eight output rows are interleaved across the vector lanes: for each block of 8
// outputs and each pair of weights (2p, 2p + 1), 16 bytes, output 8b + i's two codes at 2i and
// 2i + 1 (`int8_interleave`). So one load sign-extended to int16 is, per lane, the pair of codes of
// one output that multiplies activations 2p and 2p + 1, which one broadcast serves for all 8
// outputs, and a group's scales and los are one load per 8 outputs.
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

// int8_interleave's codes, as the shared direct path reads them (interleaved.h).
struct Int8Codes {
  const int8_t* codes;
  int64_t K;

#if defined(__AVX2__)
  static constexpr int PAIRS = 1;  // a load is 16 bytes, sign-extended: one pair per lane
  __m256i load(int64_t b, int64_t g, int l) const {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (b * K + g * G + 2 * l) * B)));
  }
  static __m256i pairs(__m256i w, int) { return w; }
  void prefetch(int64_t b, int64_t g) const {
    for (int64_t line = 0; line < G * B; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(codes + (b * K + g * G) * B + line), _MM_HINT_T0);
  }
#endif
  int32_t at(int64_t b, int64_t i, int64_t g, int64_t k) const {
    const int64_t kk = g * G + k;
    return codes[(b * K + kk - kk % 2) * B + 2 * i + kk % 2];
  }
};

}  // namespace

namespace shardline {

at::Tensor int8_interleave(const at::Tensor& codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.size(0) % B == 0 && codes.size(1) % G == 0,
              "codes must be [N, K] int8 with N a multiple of ", B, " and K of ", G);
  const int64_t N = codes.size(0), K = codes.size(1);
  // [N/8, 8, K/2, 2] -> [N/8, K/2, 8, 2]: per block, each pair of weights' codes for its 8 outputs
  return codes.contiguous().view({N / B, B, K / 2, 2}).transpose(1, 2).contiguous().view({N, K});
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& lo) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, K] float32");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = codes.size(0);
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.size(1) == K && codes.is_contiguous() &&
              N % B == 0 && K % G == 0, "codes must be int8_interleave's [N, K] int8 for K = ", K);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && lo.scalar_type() == at::kFloat && scale.is_contiguous() &&
              lo.is_contiguous() && scale.dim() == 3 && scale.size(0) == N / B && scale.size(1) == K / G &&
              scale.size(2) == B && lo.sizes() == scale.sizes(),
              "scale and lo must be [N/8, K/32, 8] float32, a block's 8 outputs innermost");
  if (M == 0) return at::empty({0, N}, x.options());
  return interleaved::multiply(Int8Codes{codes.const_data_ptr<int8_t>(), K}, xc, scale.const_data_ptr<float>(),
                               lo.const_data_ptr<float>(), N);
}

}  // namespace shardline
