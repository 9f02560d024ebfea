"""Constrained decoding's token masks (shard.proto, `SequenceStep.allowed_tokens`), as llguidance
writes them for the router (router/core/constrained.py): packed bits, token t allowed where bit
t % 8 of byte t / 8 is set, in whole 32-bit words, at least `mask_bytes` per row (bits past the
vocabulary are ignored). Applied to the logits by Shardline's kernel (token_mask.cpp) where it is
built, by torch's ops otherwise (same result)."""

from __future__ import annotations

import torch

from shardline.kernels import native


def mask_bytes(vocab_size: int) -> int:
    """The bytes of one row's mask that cover a vocabulary of `vocab_size` tokens."""
    return -(-vocab_size // 32) * 4


def packed_masks(masks: list[bytes], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Masks (each at least `mask_bytes`) -> uint8 [len(masks), mask_bytes(vocab_size)]."""
    size = mask_bytes(vocab_size)
    rows = b"".join(m[:size] for m in masks)
    return torch.frombuffer(bytearray(rows), dtype=torch.uint8).view(len(masks), size).to(device)


def unpack(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """uint8 [rows, bytes] -> bool [rows, vocab_size]."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).view(len(packed), -1)[:, :vocab_size].bool()


def mask_logits(logits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """A copy of logits [rows, vocab] with -inf at every token its row's mask does not allow."""
    if native.usable(logits) and logits.is_contiguous():
        return native.ops().mask_logits(logits, packed)
    return torch.where(unpack(packed, logits.shape[1]), logits, torch.tensor(float("-inf"), device=logits.device))
