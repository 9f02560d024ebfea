"""GGUF blocks as groups of 32 weights on a grid (kernels/grid.py: w = lo + scale * code), read
straight from a tensor's bytes: no fp32 weights, and no grid to recover.

- Q4_0: d * (q - 8): scale d, lo -8d, 4-bit codes;
- Q4_1: d * q + m: scale d, lo m;
- Q4_K: 8 sub-blocks of 32 in a super-block of 256, d * sc_j * q - dmin * m_j: scale d * sc_j,
  lo -dmin * m_j (exact in fp32; the records' fp16 rounds them where the product needs more
  than 11 bits);
- Q8_0: d * q, q in -127..127 (llama.cpp's quantizer never writes -128): scale d, lo -127d,
  8-bit codes q + 127;
- Q5_0, Q5_1, Q5_K: as Q4_0, Q4_1 and Q4_K with a fifth bit per code (codes 0..31, so served by
  the 8-bit kernel: exactly, where a 4-bit grid cannot hold them);
- MXFP4 (gpt-oss's experts): a shared power of two 2^(e - 128) times e2m1 values doubled, which
  are the integers -12..12 of a 4-bit code's table: scale 2^(e - 128), lo -127 times it, 8-bit
  codes value + 127 as Q8_0's (exactly; twice the bits of the file's).

Q6_K has no such grid (its scales are per 16 weights, two to a group of 32): the 6-bit kernel
holds its blocks as they are (kernels/int6_linear.cpp, `q6_k_pack`), exactly too; Q4_K's the
4-bit kernel packs at once (`q4_k_pack`) where a layer is all Q4_K (shard/gguf_loader.py).
Other types' rows are dequantized (the `gguf` package) for a grid to be found (`grid_groups`), a
slice of rows at a time.
"""

from __future__ import annotations

import numpy as np
import torch

GROUP = 32
BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8, "Q5_0": 8, "Q5_1": 8, "Q5_K": 8, "MXFP4": 8}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24, "Q5_K": 176, "MXFP4": 17}
BLOCK_WEIGHTS = {
    **{"Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q8_0": 32, "Q5_0": 32, "Q5_1": 32, "Q5_K": 256, "Q6_K": 256},
    "MXFP4": 32,
}
# MXFP4's 4-bit codes -> their e2m1 values doubled (gguf's and llama.cpp's table)
_E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 bytes [..., 2] -> fp32 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles are weights 0-15, the high 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 and Q5_1's 4 bytes of high bits [..., 4] -> [..., 32] values 0 or 16: bit j of the
    little-endian word is weight j's."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits.astype(np.uint8) << 4


def groups_of(kind: str, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tensor's rows of `kind` blocks, uint8 [N, blocks * block bytes] -> (codes int32 [N, K],
    scale fp32 [N, K/32], lo fp32 [N, K/32])."""
    n = rows.shape[0]
    b = np.ascontiguousarray(rows).reshape(n, -1, BLOCK_BYTES[kind])
    if kind == "Q4_0":
        d = _f16(b[..., 0:2])
        codes, scale, lo = _nibbles(b[..., 2:18]), d, -8 * d
    elif kind == "Q4_1":
        codes, scale, lo = _nibbles(b[..., 4:20]), _f16(b[..., 0:2]), _f16(b[..., 2:4])
    elif kind == "Q8_0":
        d = _f16(b[..., 0:2])
        codes, scale, lo = b[..., 2:34].view(np.int8).astype(np.int16) + 127, d, -127 * d
    elif kind == "MXFP4":
        # e8m0's 2^(e - 127), halved as the values are doubled (llama.cpp's ggml_e8m0_to_fp32_half)
        d = np.ldexp(np.float32(1), b[..., 0].astype(np.int32) - 128).astype(np.float32)
        codes, scale, lo = _E2M1_DOUBLED[_nibbles(b[..., 1:17])] + 127, d, -127 * d
    elif kind == "Q5_0":
        d = _f16(b[..., 0:2])
        codes, scale, lo = _nibbles(b[..., 6:22]) | _fifth_bits(b[..., 2:6]), d, -16 * d
    elif kind == "Q5_1":
        codes, scale, lo = _nibbles(b[..., 8:24]) | _fifth_bits(b[..., 4:8]), _f16(b[..., 0:2]), _f16(b[..., 2:4])
    elif kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        sc, m = _k4_scales(b[..., 4:16])  # [N, blocks, 8] each
        # 128 bytes = 4 chunks of 32: a chunk's low nibbles are sub-block 2c, its high ones 2c + 1
        low = b[..., -128:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        codes = (low & 0x0F).reshape(n, -1, 8, 32)
        if kind == "Q5_K":  # 32 bytes of high bits: bit j of byte l is sub-block j's weight l
            high = b[..., 16:48, None] >> np.arange(8, dtype=np.uint8)  # [N, blocks, 32 (l), 8 (j)]
            codes = codes | ((high & 1) << 4).swapaxes(-1, -2)
        scale, lo = d * sc, -(dmin * m)
    else:
        raise ValueError(f"{kind} blocks have no grid of their own here")
    return (
        torch.from_numpy(np.ascontiguousarray(codes).reshape(n, -1).astype(np.int32)),
        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(n, -1)),
        torch.from_numpy(np.ascontiguousarray(lo, dtype=np.float32).reshape(n, -1)),
    )


def _k4_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of 6-bit scales and mins per super-block -> (sc, m), fp32 [..., 8]: bytes
    0-3 hold sc 0-3 and their top bits of sc 4-7, 4-7 likewise m, 8-11 the low bits of sc and m 4-7."""
    d, m, low = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mins.astype(np.float32)


def dequantized(kind: str, rows: np.ndarray, k: int) -> torch.Tensor:
    """Rows of any GGUF type as fp32 [N, K] (the `gguf` package's reference dequantization)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(np.ascontiguousarray(dequantize(rows, GGMLQuantizationType[kind])).reshape(-1, k))
