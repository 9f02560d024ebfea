"""Log-probabilities of given tokens under the model's raw distribution (log-softmax of the
logits, before temperature, top-k and top-p), with the best alternatives.

Scoring a whole prompt needs logits at every position: a 8192-token prompt over SmolLM2's 49152-
token vocabulary would take 1.6 GB at once, so rows are scored ROWS_PER_PIECE at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardline.protos import shard_pb2

ROWS_PER_PIECE = 256  # x 49152 fp32 logits: 48 MiB
MAX_TOP = 20  # alternatives per position, at most


def from_logits(logits: torch.Tensor, targets: list[int], top: int) -> list[shard_pb2.TokenLogprob]:
    """logits [len(targets), vocab] -> per row, log p(target) and the `top` best tokens, best first."""
    lp = logits.float().log_softmax(-1)
    wanted = torch.tensor(targets, device=lp.device)
    chosen = lp.gather(1, wanted[:, None]).squeeze(1).tolist()
    best = lp.topk(top, dim=-1) if top else None
    out = []
    for r, (token, value) in enumerate(zip(targets, chosen)):
        entry = shard_pb2.TokenLogprob(token_id=token, logprob=value)
        if best is not None:
            entry.top_ids.extend(best.indices[r].tolist())
            entry.top_logprobs.extend(best.values[r].tolist())
        out.append(entry)
    return out


def score(
    logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: list[int], top: int
) -> list[shard_pb2.TokenLogprob]:
    """hidden [len(targets), H] -> `from_logits` of each row, ROWS_PER_PIECE rows at a time."""
    out = []
    for start in range(0, len(targets), ROWS_PER_PIECE):
        end = start + ROWS_PER_PIECE
        out.extend(from_logits(logits(hidden[start:end]), targets[start:end], top))
    return out
