"""Runs step plans on the model: checks each sequence's entry against what the shard holds for
it, builds the step's tensors, runs the layers, samples.

The shard holds each running sequence's block table and sampling parameters (shard/sequences.py),
so a plan names only what changed. Slots are derived here from the block tables and positions; a
decode step indexes the static block-table rows of its sequences, with no per-token Python work
beyond the step's small index tensors.

A long prefill step runs in pieces, one after the other (a long prompt is cut as chunked prefill
cuts it), so that its activations stay within PREFILL_PIECE_BYTES whatever the prompt's length.
The router still sees one step.

A small prefill step runs as decode rows, a row per token (ROWS_ATTENTION_PAIRS); so does a step
that verifies proposals, at any context: each of its rows then computes what a decode step at
that position would, to the bit, and greedy output is the same with speculation on and off.

A layer group (StepPlan.layer_start, layer_end) runs a part of the layers on its chunks; the
shard keeps each chunk's hidden states in its SequenceState until the group that runs the last
layer, which alone advances the sequence's positions, scores and samples. The layers before it
have written the chunk's K/V at their own depth, and no other step reads a position the sequence
does not hold yet, so decode steps of other sequences can run in between.

A plan entry that cannot be served (a page id outside the pool, positions its block table does
not cover, a token outside the vocabulary, a position or announcement that disagrees with what
the shard holds: plan_reader.py's rules) fails its sequence alone: it is left out of the step,
forgotten and reported. Every shard of a replica receives the same plan and judges it the same
way, so every rank leaves out the same sequences and the collectives stay matched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardline.kernels.attention import AttentionBatch, decode_capturable
from shardline.kernels.token_mask import mask_logits, packed_masks
from shardline.protos import shard_pb2
from shardline.shard.decode_graphs import DecodeGraphs
from shardline.shard.footprint import PREFILL_PIECE_BYTES
from shardline.shard.kv_cache import KVPages
from shardline.shard.layout import Layout
from shardline.shard.logprobs import from_logits, score
from shardline.shard.model import Transformer
from shardline.shard.pieces import PREFILL_PIECE_TOKENS, Span, pieces, spans_batch
from shardline.shard.plan_reader import Context, Entry, plan_layers, read
from shardline.shard.sampler import finite_rows, sample, verify
from shardline.shard.sequences import SequenceState, SequenceTable

log = logging.getLogger(__name__)
# A prefill piece whose attention is at most this many (token, context token) pairs runs as
# decode rows, a row per token, each attending its sequence's cache up to itself: through the
# fused decode layers and the decode attention (which writes every row's K/V before it attends),
# not the prefill path's dozens of torch operators per layer. That wins for a few tokens after a
# cached prefix and for short fresh prompts; past this many pairs it loses, as the decode
# attention reads the context once per row. Not on CUDA, where flash-attn's decode writes and
# reads the rows' K/V at once.
ROWS_ATTENTION_PAIRS = 32768


@dataclass
class SequenceOutput:
    """What one step made of one sequence (on the sampling shard)."""

    tokens: list[int] = field(default_factory=list)  # one sampled, or a verification's accepted proposals and one
    prompt_logprobs: list[shard_pb2.TokenLogprob] = field(default_factory=list)  # of its inputs' next tokens, if asked
    sampled_logprobs: list[shard_pb2.TokenLogprob] = field(default_factory=list)  # of each of `tokens`, if asked


@dataclass
class StepOutput:
    # seq_id -> its output, in the plan's order: a sequence that sampled or was scored, and did not fail
    sequences: dict[int, SequenceOutput] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)  # seq_id -> why
    graph_launches: int = 0  # decode graphs replayed for the step (0 or 1)
    eager_decode_steps: int = 0  # or the decode step run eagerly (0 or 1)

    @property
    def tokens(self) -> list[int]:
        """Every sequence's new tokens, one after the other in the plan's order."""
        return [t for seq in self.sequences.values() for t in seq.tokens]


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        layout: Layout = Layout(),
        vocab_size: int | None = None,
        max_position: int | None = None,
        kv_dtype: torch.dtype | None = None,
    ):
        self.model, self.page_size, self.dtype, self.device = model, page_size, dtype, device
        self.kv_dtype = kv_dtype or dtype
        self.layout = layout
        self.vocab_size = vocab_size or model.cfg.vocab_size
        self.max_position = max_position or model.cfg.max_position
        per_token = 3 * model.cfg.intermediate_size * torch.finfo(dtype).bits // 8
        self.piece_tokens = max(16, min(PREFILL_PIECE_TOKENS, PREFILL_PIECE_BYTES // per_token))
        self.kv: KVPages | None = None
        self.table: SequenceTable | None = None
        self.graphs: DecodeGraphs | None = None

    def allocate(self, num_pages: int, max_seqs: int, window_pages: int = 0, decode_graphs: bool = False) -> None:
        """A fresh KV pool (and window pool, shard/kv_cache.py) and sequence table (whatever the
        shard held before is gone), and the decode graphs that read them when asked for
        (`capture_decode_graphs`)."""
        self.kv = self.table = self.graphs = None  # let the old pool go before the new one is allocated
        windows = self.model.windows
        self.kv = KVPages(self.model.cfg, num_pages, self.page_size, self.kv_dtype, self.device, windows, window_pages)
        max_pages = -(-self.max_position // self.page_size)
        window_padding = self.kv.window_padding_page if window_pages else None
        self.table = SequenceTable(max_seqs, max_pages, self.kv.padding_page, self.device, window_padding)
        if decode_graphs:
            self.capture_decode_graphs(max_seqs)

    def capture_decode_graphs(self, max_seqs: int) -> None:
        """Captures the decode step per batch bucket (single-stage replicas only: a stage
        boundary's send/recv stays eager). It runs the forward pass, collectives included."""
        if self.layout.pp > 1:
            log.warning("decode graphs are off: pipeline stages run decode eagerly")
        elif not decode_capturable(self.device, self.dtype, self.page_size, self.kv_dtype):
            log.warning(
                "decode graphs are off: on CUDA they need flash-attn, fp16/bf16 and pages of a multiple of 256 tokens"
            )
        else:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv.layers,
                self.table.tables,
                self.table.window_tables,
                self.table.padding_row,
                self.page_size,
                max_seqs,
                self.device,
                whole=self.layout.tp == 1,
            )
            self.graphs.capture()

    def _tensor(self, data, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _accept(self, e: Entry) -> SequenceState:
        state = self.table.get(e.seq_id)
        if state is None:
            state = self.table.admit(e.seq_id, e.start_pos, e.sampling, self.model.rotary.long_rows * e.long_rope)
        elif state.verified is not None:  # the positions of the last verification it keeps
            state.next_pos, state.verified = e.start_pos, None
        self.table.append_pages(state, list(e.new_pages), list(e.new_window_pages))
        if self.table.window_tables is not None:
            self.table.forget_outside(state, self.model.cfg.sliding_window, e.start_pos, self.page_size)
        return state

    def _decode_batch(self, tokens: list[int], states: list[SequenceState]):
        """(tokens, rotary rows, attention batch) of a decode step: the model's inputs."""
        positions = self._tensor([st.next_pos for st in states])
        width = max(len(st.pages) for st in states)
        rows = self._tensor([st.row for st in states])
        batch = AttentionBatch.decode(self.table.tables[rows, :width], positions, self.page_size)
        if self.table.window_tables is not None:
            batch.windowed = AttentionBatch.decode(self.table.window_tables[rows, :width], positions, self.page_size)
        return self._tensor(tokens), self._rotary_rows(positions, [st.rotary_base for st in states]), batch

    def _rotary_rows(self, positions: torch.Tensor, bases: list[int], counts: list[int] | None = None) -> torch.Tensor:
        """Each position's row of the rotary tables: itself, past `bases` (per sequence, of
        `counts` positions each) where a sequence turns by long factors."""
        if not any(bases):
            return positions
        offsets = self._tensor(bases)
        return positions + (offsets if counts is None else offsets.repeat_interleave(self._tensor(counts)))

    def _prefill_batch(self, spans: list[Span], as_rows: bool = False):
        tokens = self._tensor([t for s in spans for t in s.token_ids])
        positions = torch.cat(
            [torch.arange(s.start_pos, s.start_pos + len(s.token_ids), device=self.device) for s in spans]
        )
        counts = [len(s.token_ids) for s in spans]
        pairs = sum(len(s.token_ids) * (s.start_pos + len(s.token_ids)) for s in spans)
        as_rows = self.device.type == "cpu" and (as_rows or pairs <= ROWS_ATTENTION_PAIRS)  # as decode rows
        ps = self.page_size
        batch = spans_batch(spans, positions, [s.block_table for s in spans], self.kv.padding_page, ps, as_rows)
        if spans[0].window_table is not None:
            tables = [s.window_table for s in spans]
            batch.windowed = spans_batch(spans, positions, tables, self.kv.window_padding_page, ps, as_rows)
        return tokens, self._rotary_rows(positions, [s.rotary_base for s in spans], counts), batch

    def _forward(self, tokens, positions, batch, hidden_in=None, layers: slice = slice(None)) -> torch.Tensor | None:
        """Runs this shard's layers (`layers` of them, from `hidden_in` when they start past the
        first); the hidden states [T, hidden] on the last stage, else None (they went to the
        next stage)."""
        layout = self.layout
        if not layout.is_first_stage:
            hidden_in = torch.empty(len(tokens), self.model.cfg.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(hidden_in, src=layout.peer(layout.pp_stage - 1))
        hidden = self.model(tokens, positions, self.kv.layers, batch, hidden_in, layers)
        if not layout.is_last_stage:
            dist.send(hidden, dst=layout.peer(layout.pp_stage + 1))
            return None
        return hidden

    def _context(self, layer_start: int, finishing: bool) -> Context:
        held = len(self.table.held)
        return Context(
            layer_start,
            finishing,
            self.vocab_size,
            self.max_position,
            self.page_size,
            self.table.max_pages,
            self.kv.padding_page,  # the pool's pages come before it
            held,
            self.table.has_room(),
            self.model.rotary.long_rows > 0,
            self.kv.window_padding_page,  # the window pool's pages come before it (0: no pool)
        )

    @torch.inference_mode()
    def step(self, plan) -> StepOutput:
        """plan: a StepPlan. Samples one token per valid sequence with emit set (on the sampling
        shard). An exception here leaves the shard's state unknown."""
        out = StepOutput()
        for seq_id in plan.released:
            self.table.release(seq_id)
        layers, layers_why = plan_layers(plan, len(self.model.layers), self.layout.pp)
        finishing = layers.stop == len(self.model.layers)
        entries, states = self._admit(plan, layers_why, layers.start, finishing, out.failures)
        if not entries:
            return out
        scored = {i for i, e in enumerate(entries) if e.prompt_logprobs is not None} if finishing else set()
        last, every, chunks = self._compute(entries, states, layers, scored, out)
        for i, (e, st) in enumerate(zip(entries, states)):
            st.sampled = None  # until this step samples it a token
            if finishing:
                st.next_pos += len(e.tokens)
                # Positions up to the last input are the sequence's; the proposals' may be rejected.
                st.verified = st.next_pos - len(e.proposals) if e.proposals else None
                st.partial, st.partial_layers = None, 0
            else:
                st.partial, st.partial_layers = chunks[i], layers.stop
        if finishing and self.layout.samples:
            self._sample(entries, states, last, every, out)
        return out

    def _admit(self, plan, why: str | None, layer_start: int, finishing: bool, failures: dict[int, str]):
        """The plan's entries this shard can serve, each with its state (a new sequence's
        admitted here); the others fail and are forgotten."""
        entries, states = [], []
        for s in plan.seqs:  # each judged by the rows the entries before it left free
            read_as = why or read(s, self.table.get(s.seq_id), self._context(layer_start, finishing))
            if isinstance(read_as, Entry):
                entries.append(read_as)
                states.append(self._accept(read_as))
            else:
                failures[s.seq_id] = read_as
                self.table.release(s.seq_id)
        return entries, states

    def _compute(self, entries, states, layers: slice, scored: set[int], out: StepOutput):
        """Runs the step's layers. Returns the last position's hidden state of each entry, every
        position's of those `scored` (and of those verifying proposals), and in a layer group
        that stops short of the last layer each chunk's hidden states to keep."""
        if layers != slice(0, len(self.model.layers)):  # a layer group: every chunk's hidden states are kept
            last, chunks = self._prefill(entries, states, set(range(len(entries))), layers)
            return last, {i: chunks[i] for i in scored}, chunks
        if all(len(e.tokens) == 1 for e in entries):  # a decode step (or one-token chunks)
            tokens = [e.tokens[0] for e in entries]
            if self.graphs is not None and self.graphs.bucket_for(len(entries)):
                last = self.graphs.run(tokens, [st.next_pos for st in states], [st.row for st in states])
                out.graph_launches = 1
            else:
                last = self._forward(*self._decode_batch(tokens, states))
                out.eager_decode_steps = 1
            return last, {i: last[i : i + 1] for i in scored} if last is not None else {}, {}
        # A step of verifications and decode rows computes each row as a decode step would.
        as_rows = all(e.proposals or len(e.tokens) == 1 for e in entries)
        verifying = {i for i, e in enumerate(entries) if e.proposals}
        last, every = self._prefill(entries, states, scored | verifying, as_rows=as_rows)
        return last, every, {}

    def _prefill(self, entries, states, kept_for: set[int], layers: slice = slice(None), as_rows: bool = False):
        """Runs a prefill step (or the layer group `layers` of one) in pieces. Returns the hidden
        state of each sequence's last token [n, H], and all hidden states of the sequences in
        `kept_for` (for prompt log-probabilities, or a layer group's partial chunks); (None, {})
        off the last stage. `as_rows`: every token as a decode row, however long its context."""
        spans = [
            Span(
                e.tokens,
                e.start_pos,
                self.table.tables[st.row, : len(st.pages)],
                st.rotary_base,
                self._window_table(st),
            )
            for e, st in zip(entries, states)
        ]
        rows = [None] * len(spans)
        kept: dict[int, list[torch.Tensor]] = {i: [] for i in kept_for}
        for piece in pieces(spans, self.piece_tokens):
            hidden_in = None
            if layers.start:  # the chunks' hidden states after the layers before this group
                hidden_in = torch.cat(
                    [
                        states[i].partial[span.start_pos - spans[i].start_pos :][: len(span.token_ids)]
                        for i, span in piece
                    ]
                )
            hidden = self._forward(*self._prefill_batch([span for _, span in piece], as_rows), hidden_in, layers)
            if hidden is None:
                continue
            end = 0
            for i, span in piece:
                start, end = end, end + len(span.token_ids)
                rows[i] = hidden[end - 1].clone()  # copies, not views: the piece is freed
                if i in kept:
                    kept[i].append(hidden[start:end].clone())
        if rows[0] is None:
            return None, {}
        return torch.stack(rows), {i: torch.cat(parts) for i, parts in kept.items()}

    def _window_table(self, st: SequenceState) -> torch.Tensor | None:
        tables = self.table.window_tables
        return None if tables is None else tables[st.row, : len(st.pages)]

    def _sample(self, entries, states, last, every: dict[int, torch.Tensor], out: StepOutput) -> None:
        """On the sampling shard: scores prompt positions, samples emitting sequences (verifies
        those with proposals), and adds the log-probabilities asked for."""
        made = {e.seq_id: SequenceOutput() for e in entries}  # in the plan's order
        for i, e in enumerate(entries):
            if e.prompt_logprobs is not None:
                targets = [*e.tokens[1:], *([e.next_token] if e.next_token is not None else [])]
                made[e.seq_id].prompt_logprobs = score(
                    self.model.logits, every[i][: len(targets)], targets, e.prompt_logprobs
                )
        drawn = self._draws(entries, states, last) | self._verifications(entries, states, every)
        for i, (tokens, failure, logits) in drawn.items():
            seq_id = entries[i].seq_id
            if failure is not None:
                out.failures[seq_id] = failure
                self.table.release(seq_id)
                del made[seq_id]
                continue
            states[i].sampled = tokens[-1]
            made[seq_id].tokens = tokens
            top = states[i].sampling.logprobs
            if top is not None:
                made[seq_id].sampled_logprobs = from_logits(logits[: len(tokens)], tokens, top)
        out.sequences = {seq_id: seq for seq_id, seq in made.items() if seq.tokens or seq.prompt_logprobs}

    def _draws(self, entries, states, last) -> dict[int, tuple[list[int], str | None, torch.Tensor]]:
        """The token of each emitting entry without proposals, by its index: ([token], failure,
        its logits row)."""
        emitting = [i for i, e in enumerate(entries) if e.emit and not e.proposals]
        if not emitting:
            return {}
        logits = self.model.logits(last[torch.tensor(emitting, device=self.device)])
        sampled_at = [states[i].next_pos for i in emitting]
        masked = [row for row, i in enumerate(emitting) if entries[i].allowed_tokens]
        packed = (
            packed_masks([entries[emitting[row]].allowed_tokens for row in masked], self.vocab_size, self.device)
            if masked
            else None
        )
        draws = sample(logits, [states[i].sampling for i in emitting], sampled_at, masked, packed)
        rows = enumerate(zip(emitting, draws))
        return {i: ([draw.token], draw.failure, logits[row : row + 1]) for row, (i, draw) in rows}

    def _verifications(self, entries, states, every) -> dict[int, tuple[list[int], str | None, torch.Tensor]]:
        """The tokens of each entry with proposals, by its index: (tokens, failure, the logits of
        the rows that chose them). Its last k + 1 rows take the last input and the k proposals."""
        out = {}
        for i, e in enumerate(entries):
            if not e.proposals:
                continue
            k = len(e.proposals)
            logits = drawn_from = self.model.logits(every[i][-(k + 1) :])
            if not all(finite_rows(logits)):
                out[i] = ([], "the model produced non-finite logits for this sequence", logits)
                continue
            if e.allowed_tokens:  # each row masked as a sampled token's; logprobs stay raw
                packed = packed_masks([e.allowed_tokens, *e.proposal_masks], self.vocab_size, self.device)
                if not bool(packed.any(dim=-1).all()):
                    out[i] = ([], "the constraint allows no token here", logits)
                    continue
                drawn_from = mask_logits(logits.contiguous(), packed)
            # next_pos has moved past the proposals: the first row's token sits k positions before it.
            tokens = verify(drawn_from, list(e.proposals), states[i].sampling, states[i].next_pos - k)
            out[i] = (tokens, None, logits)
        return out
