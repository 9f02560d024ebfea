"""Where a shard sits in its replica: its pipeline stage and tensor-parallel rank, and the layers
of each stage. Torch-free: the launcher plans its shards' memory with it (shard/footprint.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    tp_rank: int = 0
    pp_stage: int = 0

    @property
    def rank(self) -> int:
        return self.pp_stage * self.tp + self.tp_rank

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_stage == self.pp - 1

    @property
    def samples(self) -> bool:
        """Only the last stage's rank 0 computes logits and samples."""
        return self.is_last_stage and self.tp_rank == 0

    def peer(self, stage: int) -> int:
        return stage * self.tp + self.tp_rank


def layer_range(num_layers: int, stage: int, pp: int) -> range:
    """Stage `stage`'s layers, split as evenly as possible (earlier stages take the remainder)."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))
