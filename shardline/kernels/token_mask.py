"""Constrained decoding's token masks on the logits (router/constraints.py makes them): packed
bits, token t allowed where bit t % 8 of byte t / 8 is set, in whole 32-bit words per row.
Shardline's kernel (token_mask.cpp) where it is built, torch's ops otherwise (same result)."""
from __future__ import annotations

import torch

from shardline.kernels import native


def packed_masks(masks: list[bytes], device: torch.device) -> torch.Tensor:
    """Masks of equal size -> uint8 [len(masks), bytes]."""
    return torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.uint8).view(len(masks), -1).to(device)


def unpack(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """uint8 [rows, bytes] -> bool [rows, vocab_size]."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).view(len(packed), -1)[:, :vocab_size].bool()


def mask_logits(logits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """A copy of logits [rows, vocab] with -inf at every token its row's mask does not allow."""
    if native.usable(logits) and logits.is_contiguous():
        return native.ops().mask_logits(logits, packed)
    return torch.where(unpack(packed, logits.shape[1]), logits, torch.tensor(float("-inf"), device=logits.device))
