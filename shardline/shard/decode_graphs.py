"""Decode graphs: the decode step (embedding to the hidden states of the sampled positions),
captured once per batch-size bucket at warmup and replayed with static input buffers.

A step of n sequences runs in the smallest bucket >= n; its rows past n are padding (token 0 at
position 0 of the padding row, whose block table is all padding page, so they write and read
only the reserved padding page). The graph reads the sequences' block tables from the shard's
static table (shard/sequences.py) by row, so a step copies only n tokens, positions and rows
into the bucket's buffers.

- CUDA: `torch.cuda.CUDAGraph` over the eager forward; flash-attn's paged decode and NCCL
  all-reduces are capturable, so TP ranks capture their collectives too.
- CPU: `torch.compile` (inductor) of the same forward, specialized per bucket, with paged
  attention as one opaque operator (kernels/attention.py). A TP rank's gloo all-reduces are
  not traceable: the step compiles in pieces between them, and each replay runs them all.
  Compiled code is cached on disk (TORCHINDUCTOR_CACHE_DIR, per build of the kernels: shard/load.py),
  so a restart reuses it.

The runner counts a launch at each `run` call, which issues exactly one replay.
"""

from __future__ import annotations

import logging
import time

import torch
from tqdm import tqdm

from shardline.kernels import native
from shardline.kernels.attention import AttentionBatch

log = logging.getLogger(__name__)


def buckets_for(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, ... up to max_batch, and max_batch itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class _Bucket:
    """The static buffers of one bucket and the graph that reads them."""

    def __init__(self, size: int, device: torch.device, padding_row: int):
        self.tokens = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.rows = torch.full((size,), padding_row, dtype=torch.int64, device=device)
        self.output: torch.Tensor | None = None  # CUDA: the captured graph's output buffer
        self.graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_layers,
        tables: torch.Tensor,
        window_tables: torch.Tensor | None,
        padding_row: int,
        page_size: int,
        max_batch: int,
        device: torch.device,
        whole: bool = True,
    ):
        self.model, self.kv_layers, self.tables = model, kv_layers, tables
        self.window_tables = window_tables  # of the window pool's pages, where there is one
        self.page_size, self.device = page_size, device
        self.padding_row = padding_row
        self.buckets = {b: _Bucket(b, device, padding_row) for b in buckets_for(max_batch)}
        self.whole = whole  # False: compile in pieces around the collectives
        self.capture_s = 0.0
        self._compiled = None

    def _forward(self, bucket: _Bucket, opaque: bool) -> torch.Tensor:
        batch = AttentionBatch.decode(self.tables[bucket.rows], bucket.positions, self.page_size, opaque)
        if self.window_tables is not None:
            batch.windowed = AttentionBatch.decode(
                self.window_tables[bucket.rows], bucket.positions, self.page_size, opaque
            )
        return self.model(bucket.tokens, bucket.positions, self.kv_layers, batch)

    def capture(self) -> None:
        """Captures (CUDA) or compiles (CPU) every bucket, largest first; logs progress."""
        t0 = time.perf_counter()
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            self._capture_cuda()
        else:
            import torch._dynamo

            native.available()  # built and loaded before tracing: the graphs then call its operators
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(self.buckets))
            self._compiled = torch.compile(self._forward, dynamic=False, fullgraph=self.whole)
            for size in tqdm(sorted(self.buckets, reverse=True), desc="decode graphs", unit="graph"):
                with torch.inference_mode():
                    self._compiled(self.buckets[size], True)
        self.capture_s = time.perf_counter() - t0
        log.info(
            "captured %d decode graphs (batch %s) in %.1f s", len(self.buckets), sorted(self.buckets), self.capture_s
        )

    def _capture_cuda(self) -> None:  # pragma: no cover - needs a GPU
        pool = None
        stream = torch.cuda.Stream()
        for size in tqdm(sorted(self.buckets, reverse=True), desc="decode graphs", unit="graph"):
            bucket = self.buckets[size]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                self._forward(bucket, False)  # warm up kernels outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            bucket.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bucket.graph, pool=pool), torch.inference_mode():
                bucket.output = self._forward(bucket, False)
            pool = bucket.graph.pool()  # smaller buckets share the largest one's memory

    def bucket_for(self, n: int) -> int | None:
        fits = [b for b in self.buckets if b >= n]
        return min(fits) if fits else None

    def run(self, tokens: list[int], positions: list[int], rows: list[int]) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode step of n sequences (n must fit a bucket)."""
        n = len(tokens)
        bucket = self.buckets[self.bucket_for(n)]
        bucket.tokens[:n] = torch.tensor(tokens)
        bucket.positions[:n] = torch.tensor(positions)
        bucket.rows[:n] = torch.tensor(rows)
        bucket.tokens[n:], bucket.positions[n:], bucket.rows[n:] = 0, 0, self.padding_row
        if bucket.graph is not None:  # pragma: no cover - needs a GPU
            bucket.graph.replay()
            hidden = bucket.output
        else:
            hidden = self._compiled(bucket, True)
        return hidden[:n]
