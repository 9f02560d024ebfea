// Constrained decoding's token mask, applied to the logits: every token whose bit is clear gets
// -inf. One pass over the packed words; a word of all ones (the common case: most of a JSON
// string's vocabulary is allowed) is skipped, one of all zeros is filled whole.

#include "native.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cstring>

namespace shardline {

at::Tensor mask_logits(const at::Tensor& logits, const at::Tensor& packed) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "mask_logits: logits must be contiguous float32 [rows, vocab]");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(0) == logits.size(0) && packed.size(1) % 4 == 0 && packed.size(1) * 8 >= logits.size(1),
              "mask_logits: packed must be contiguous uint8 [rows, whole 32-bit words covering vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = packed.size(1) / 4;
  at::Tensor out = logits.clone();
  // -inf by its bits: -ffast-math lets the compiler assume no float is infinite.
  const uint32_t minus_inf = 0xFF800000u;
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr<float>());
  const auto* bits = packed.data_ptr<uint8_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint32_t* row = dst + r * vocab;
      for (int64_t w = 0; w < words && w * 32 < vocab; ++w) {
        uint32_t word;
        std::memcpy(&word, bits + (r * words + w) * 4, 4);  // little-endian, as llguidance writes it
        if (word == 0xFFFFFFFFu) continue;
        const int64_t base = w * 32, n = std::min<int64_t>(32, vocab - base);
        for (int64_t j = 0; j < n; ++j)
          if (!((word >> j) & 1u)) row[base + j] = minus_inf;
      }
    }
  });
  return out;
}

}  // namespace shardline
