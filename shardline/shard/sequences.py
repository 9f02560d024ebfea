"""The shard's copy of what the router told it about each sequence it is running: the block
table, the sampling parameters and how many positions of K/V this shard holds, plus one row of a
static block-table tensor that decode steps index instead of rebuilding tables per step.

The router owns every page id and every decision; this is a cache of its messages, so that a
decode step's plan names only the new token (and a new page when one was appended). A plan
entry that disagrees with the cache fails that sequence, with a message saying how (see
`shard/plan_reader.py`); it is never silently re-synchronized.

With a window pool (shard/kv_cache.py) each row has a second table, `window_tables[row]`, of
the windowed layers' pages for the same positions. A window pool page is forgotten (its entry
set to the window pool's padding page) as soon as the window of a step's first position leaves it
behind, by the rule the router frees it by (shard.proto, `new_window_pages`).

Invariants kept here:
- every held sequence has exactly one row, and no two share one;
- `tables[row]` holds the sequence's pages in order, then the padding page up to the width;
  `window_tables[row]` the same of its window pages, the ones forgotten being padding;
- a released (or never admitted) row holds only the padding page, so a stale row can never
  address a page the router has given to someone else (nor a forgotten window page); the last
  row (`padding_row`) is never given out: padding entries of a captured decode batch read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardline.shard.sampler import SamplingParams


@dataclass
class SequenceState:
    row: int  # its row of SequenceTable.tables
    pages: list[int]  # its block table, as the router sent it
    sampling: SamplingParams
    next_pos: int  # positions whose K/V this shard holds
    rotary_base: int = 0  # the rotary tables' row of its position 0 (Rotary: the long factors' rows)
    sampled: int | None = None  # the token it sampled in its last step, if that step emitted
    # A prompt chunk part way through the layers (StepPlan.layer_start): the hidden states of
    # its tokens after `partial_layers` layers. Its positions are not in `next_pos` until the
    # step that runs the last layer.
    partial: torch.Tensor | None = None
    partial_layers: int = 0
    # After a verification (SequenceStep.proposals): the position after its last input. This
    # shard wrote `next_pos` positions, but holds only those up to the next plan's start_pos,
    # which lies between the two: the router alone learns how many proposals were accepted.
    verified: int | None = None
    forgotten: int = 0  # with a window pool: its first window pages that were forgotten

    def holds_verified(self, start_pos: int) -> bool:
        """Whether a plan may go on from `start_pos`: a position its last verification settles."""
        return self.verified is not None and self.verified <= start_pos <= self.next_pos

    def held_positions(self) -> str:
        return str(self.next_pos) if self.verified is None else f"{self.verified} to {self.next_pos}"


class SequenceTable:
    def __init__(
        self, rows: int, max_pages: int, padding_page: int, device: torch.device, window_padding_page: int | None = None
    ):
        """`window_padding_page`: the window pool's (None: there is no window pool)."""
        self.padding_page, self.padding_row = padding_page, rows
        self.tables = torch.full((rows + 1, max_pages), padding_page, dtype=torch.int64, device=device)
        self.window_padding_page = window_padding_page
        self.window_tables = None
        if window_padding_page is not None:
            self.window_tables = torch.full_like(self.tables, window_padding_page)
        self._free_rows = list(range(rows - 1, -1, -1))
        self.held: dict[int, SequenceState] = {}

    @property
    def max_pages(self) -> int:
        return self.tables.shape[1]

    def has_room(self) -> bool:
        return bool(self._free_rows)

    def get(self, seq_id: int) -> SequenceState | None:
        return self.held.get(seq_id)

    def admit(self, seq_id: int, start_pos: int, sampling: SamplingParams, rotary_base: int = 0) -> SequenceState:
        state = SequenceState(self._free_rows.pop(), [], sampling, start_pos, rotary_base)
        self.held[seq_id] = state
        return state

    def append_pages(self, state: SequenceState, pages: list[int], window_pages: list[int] = ()) -> None:
        """Appends `pages` to its block table and, with a window pool, `window_pages` (as many, for
        the same positions) to its window table."""
        if pages:
            n = len(state.pages)
            self.tables[state.row, n : n + len(pages)] = torch.tensor(pages, dtype=torch.int64)
            if window_pages:
                self.window_tables[state.row, n : n + len(pages)] = torch.tensor(window_pages, dtype=torch.int64)
            state.pages.extend(pages)

    def forget_outside(self, state: SequenceState, window: int, start_pos: int, page_size: int) -> None:
        """Forgets the window pages of positions below `start_pos - window + 1`: no query from
        `start_pos` on sees them, and the router gives them back to the pool."""
        gone = min(max(0, start_pos - window + 1) // page_size, len(state.pages))
        if gone > state.forgotten:
            self.window_tables[state.row, state.forgotten : gone] = self.window_padding_page
            state.forgotten = gone

    def release(self, seq_id: int) -> None:
        """Forgets a sequence. Idempotent: the router releases every sequence it announced, also
        one this shard already forgot because it failed here."""
        state = self.held.pop(seq_id, None)
        if state is not None:
            self.tables[state.row].fill_(self.padding_page)
            if self.window_tables is not None:
                self.window_tables[state.row].fill_(self.window_padding_page)
            self._free_rows.append(state.row)

    def release_all(self) -> None:
        for seq_id in list(self.held):
            self.release(seq_id)
