"""The shard's model runner on a tiny model, in process: prefill pieces, chunks, and the
sequence state it holds between steps (the plan names only what changed)."""

import pytest
import torch

import shardline.shard.runner as runner_module
from shardline.common.model_source import resolve_model
from shardline.kernels.token_mask import mask_bytes
from shardline.protos import shard_pb2
from shardline.shard.pieces import Span, pieces
from shardline.shard.runner import ModelRunner
from shardline.shard.transforms import use_native_ops
from shardline.shard.weights import build_model

PAGE = 8


@pytest.fixture(scope="module")
def model(tiny_models):
    model = build_model(resolve_model(str(tiny_models["qwen3"])), torch.float32, torch.device("cpu"))
    use_native_ops(model)  # as a CPU shard serves it
    return model


def _runner(model, num_pages=16, max_seqs=8):
    runner = ModelRunner(model, PAGE, torch.float32, torch.device("cpu"))
    runner.allocate(num_pages, max_seqs)
    return runner


def _first(seq_id, tokens, pages, start=0, emit=True):
    return shard_pb2.SequenceStep(
        seq_id=seq_id,
        first=True,
        token_ids=tokens,
        start_pos=start,
        new_pages=pages,
        emit=emit,
        sampling=shard_pb2.Sampling(top_p=1.0),
    )


def _next(seq_id, tokens, start, pages=(), emit=True):
    return shard_pb2.SequenceStep(seq_id=seq_id, token_ids=tokens, start_pos=start, new_pages=pages, emit=emit)


def _plan(*seqs, released=()):
    return shard_pb2.StepPlan(seqs=seqs, released=released)


def test_intermediate_chunks_compute_no_logits_and_write_the_same_kv(model):
    prompt = list(range(300, 341))  # 41 tokens over pages of 8

    def run(chunks: list[int]):
        runner, pos, tokens, lm_head_calls = _runner(model), 0, [], []
        hook = model.lm_head.register_forward_hook(lambda *_: lm_head_calls.append(1))
        try:
            for i, n in enumerate(chunks):
                emit = pos + n == len(prompt)
                step = (
                    _first(1, prompt[:n], list(range(6)), emit=emit)
                    if i == 0
                    else _next(1, prompt[pos : pos + n], pos, emit=emit)
                )
                tokens += runner.step(_plan(step)).tokens
                pos += n
        finally:
            hook.remove()
        kv = torch.stack([k[:6] for k, _ in runner.kv.layers])
        return tokens, len(lm_head_calls), kv

    whole_tokens, whole_calls, whole_kv = run([41])
    chunk_tokens, chunk_calls, chunk_kv = run([7, 7, 7, 7, 7, 5, 1])  # a one-token final tail
    assert whole_calls == chunk_calls == 1
    assert chunk_tokens == whole_tokens
    torch.testing.assert_close(chunk_kv, whole_kv, rtol=1e-5, atol=1e-5)


def test_a_long_prefill_step_runs_in_pieces_with_the_same_tokens_and_kv(model, monkeypatch):
    steps = [
        _first(1, list(range(300, 341)), list(range(6))),
        _first(2, list(range(500, 503)), [6]),
        _first(3, list(range(700, 720)), [7, 8, 9], emit=False),
    ]

    def run(limit):
        monkeypatch.setattr(runner_module, "PREFILL_PIECE_TOKENS", limit)
        runner = _runner(model)
        out = runner.step(_plan(*steps))
        return out.tokens, torch.stack([k[:10] for k, _ in runner.kv.layers])

    spans = [Span(list(s.token_ids), s.start_pos, torch.tensor(list(s.new_pages))) for s in steps]
    assert [[(i, len(s.token_ids), s.start_pos) for i, s in p] for p in pieces(spans, 16)] == [
        [(0, 16, 0)],
        [(0, 16, 16)],
        [(0, 9, 32), (1, 3, 0), (2, 4, 0)],
        [(2, 16, 4)],
    ]
    whole_tokens, whole_kv = run(4096)
    piece_tokens, piece_kv = run(16)
    assert piece_tokens == whole_tokens and len(whole_tokens) == 2
    torch.testing.assert_close(piece_kv, whole_kv, rtol=1e-5, atol=1e-5)


def test_a_small_prefill_runs_as_decode_rows_and_computes_what_the_prefill_path_does(model, monkeypatch):
    """Up to ROWS_ATTENTION_PAIRS a prefill step runs as decode rows, one per token, each attending its
    sequence's cache up to itself; prompts, a chunk after cached context and a mix of sequences
    give the prefill path's tokens, log-probabilities and K/V."""
    import shardline.kernels.attention as attention

    prompt = list(range(300, 341))

    def run(limit):
        monkeypatch.setattr(runner_module, "ROWS_ATTENTION_PAIRS", limit)
        prefill_calls = []
        monkeypatch.setattr(attention, "_prefill_torch", lambda *a: prefill_calls.append(1) or prefill(*a))
        runner, out = _runner(model), []
        first = _first(1, prompt[:20], list(range(6)), emit=False)
        out.append(runner.step(_plan(first, _first(2, list(range(500, 503)), [6]))))
        step = _next(1, prompt[20:], 20)
        step.sampling.logprobs = 3
        step.prompt_logprobs = 2
        out.append(runner.step(_plan(step)))
        kv = torch.stack([k[:7] for k, _ in runner.kv.layers])
        return out, kv, len(prefill_calls)

    prefill = attention._prefill_torch
    (as_prefill, prefill_kv, calls) = run(0)
    assert calls > 0
    (as_rows, rows_kv, calls) = run(1 << 20)
    assert calls == 0
    assert [o.tokens for o in as_rows] == [o.tokens for o in as_prefill] and len(as_rows[0].tokens) == 1
    torch.testing.assert_close(rows_kv, prefill_kv, rtol=1e-5, atol=1e-5)
    rows_lp, prefill_lp = as_rows[1].sequences[1], as_prefill[1].sequences[1]
    assert len(rows_lp.prompt_logprobs) == len(prefill_lp.prompt_logprobs) == 20
    rows_all = [*rows_lp.prompt_logprobs, *rows_lp.sampled_logprobs]
    for got, want in zip(rows_all, [*prefill_lp.prompt_logprobs, *prefill_lp.sampled_logprobs]):
        assert got.token_id == want.token_id and abs(got.logprob - want.logprob) < 1e-4
        assert list(got.top_ids) == list(want.top_ids) and len(got.top_ids) > 0


def _decode(runner, seq_id, token, start, steps, page_of=None):
    """Greedy decode of `steps` tokens; a new page id from page_of(position) when one is needed."""
    out = []
    for pos in range(start, start + steps):
        pages = [page_of(pos)] if page_of and pos % PAGE == 0 else []
        result = runner.step(_plan(_next(seq_id, [token], pos, pages)))
        assert not result.failures, result.failures
        token = result.tokens[0]
        out.append(token)
    return out


def test_a_plan_that_disagrees_with_what_the_shard_holds_fails_that_sequence_alone(model):
    prompt = list(range(100, 111))
    alone = _runner(model)
    first = alone.step(_plan(_first(1, prompt, [0, 1]))).tokens
    reference = first + _decode(alone, 1, first[0], len(prompt), 8, page_of=lambda pos: 2)

    runner = _runner(model)
    runner.step(_plan(_first(1, prompt, [0, 1]), _first(2, prompt, [3, 4])))
    wrong = {
        3: (_next(3, [5], 0), "does not hold"),  # never announced
        2: (_first(2, [5], [5], start=11), "already holds it"),  # announced twice
    }
    out = runner.step(_plan(_next(1, [first[0]], len(prompt)), *(s for s, _ in wrong.values())))
    assert set(out.failures) == {2, 3}
    for seq_id, (_, phrase) in wrong.items():
        assert phrase in out.failures[seq_id]
    assert 2 not in runner.table.held, "a failed sequence is forgotten"
    # Sequence 1 went on as if alone; a wrong position fails it, and it is then forgotten.
    rest = _decode(runner, 1, out.tokens[0], len(prompt) + 1, 7, page_of=lambda pos: 2)
    assert out.tokens + rest == reference[1:]
    bad = runner.step(_plan(_next(1, [rest[-1]], len(prompt) + 7)))
    assert "holds 19 positions" in bad.failures[1] and not runner.table.held


def test_released_sequences_free_their_row_and_a_full_shard_refuses_more(model):
    runner = _runner(model, max_seqs=2)
    out = runner.step(_plan(_first(1, [1, 2], [0]), _first(2, [3, 4], [1]), _first(3, [5, 6], [2])))
    assert list(out.failures) == [3] and "its maximum" in out.failures[3]
    row = runner.table.held[1].row
    assert runner.table.tables[row, 0] == 0
    out = runner.step(_plan(_first(3, [5, 6], [2]), released=[1, 1, 7]))  # idempotent, unknown ids too
    assert not out.failures and set(runner.table.held) == {2, 3}
    assert runner.table.held[3].row == row and runner.table.tables[row, 0] == 2
    assert (runner.table.tables[row, 1:] == runner.kv.padding_page).all(), "a stale page stayed in a reused row"


def test_a_token_mask_constrains_the_sampled_token_and_one_of_the_wrong_size_fails_its_sequence(model):
    prompt = list(range(100, 111))
    free = _runner(model).step(_plan(_first(1, prompt, [0, 1]))).tokens[0]
    vocab = model.cfg.vocab_size
    mask = bytearray(mask_bytes(vocab))
    mask[5] = 1 << 3  # token 43 only
    runner = _runner(model)
    masked, wrong = _first(1, prompt, [0, 1]), _first(2, prompt, [3, 4])
    masked.allowed_tokens, wrong.allowed_tokens = bytes(mask), bytes(mask[:-4])
    out = runner.step(_plan(masked, wrong))
    assert free != 43 and out.tokens == [43]
    assert "token mask of" in out.failures[2] and 2 not in runner.table.held


def test_a_decode_step_with_the_sampled_input_continues_from_the_token_this_shard_sampled(model):
    """A plan sent before the router saw the previous step's token names no input: the shard's
    own sampled token is the input, and the tokens are those of plans that name it."""
    prompt = list(range(100, 111))
    named = _runner(model)
    first = named.step(_plan(_first(1, prompt, [0, 1]))).tokens
    reference = first + _decode(named, 1, first[0], len(prompt), 6, page_of=lambda pos: 2)

    runner = _runner(model)
    tokens = runner.step(_plan(_first(1, prompt, [0, 1]), _first(2, prompt[:5], [3], emit=False))).tokens
    for pos in range(len(prompt), len(prompt) + 6):
        sampled = _next(1, [], pos, [2] if pos % PAGE == 0 else [])
        sampled.sampled_input = True
        out = runner.step(_plan(sampled))
        assert not out.failures, out.failures
        tokens += out.tokens
    assert tokens == reference
    # No sampled token to take: after a step that emitted none, or with input tokens named too.
    chunk, both = _next(2, [], 5), _next(1, [tokens[-1]], len(prompt) + 6)
    chunk.sampled_input = both.sampled_input = True
    out = runner.step(_plan(chunk, both))
    assert "sampled none" in out.failures[2] and "input tokens" in out.failures[1] and not runner.table.held


def test_a_chunk_run_in_layer_groups_computes_what_it_computes_whole(model):
    """Layer groups: steps that run a part of the layers each, the shard keeping the chunk's
    hidden states between them; another sequence's decode steps run in between. The tokens,
    prompt log-probabilities and K/V are those of the whole chunk, and the positions count only
    once the last layer ran."""
    num_layers = len(model.layers)
    assert num_layers >= 2
    prompt, other = list(range(300, 341)), list(range(500, 505))

    def run(groups: list[tuple[int, int]]):
        runner = _runner(model)
        first = runner.step(_plan(_first(2, other, [7]))).tokens
        decoded = []
        for i, (start, end) in enumerate(groups):
            last = end == num_layers
            entry = _first(1, prompt, list(range(6)), emit=last) if i == 0 else _next(1, prompt, 0, emit=last)
            entry.prompt_logprobs = 2
            plan = _plan(entry)
            plan.layer_start, plan.layer_end = start, 0 if last else end
            out = runner.step(plan)
            assert not out.failures, out.failures
            assert runner.table.held[1].next_pos == (len(prompt) if last else 0)
            assert bool(out.tokens) == last and bool(out.sequences) == last
            if not last:  # the other sequence decodes between the groups
                decoded += _decode(
                    runner, 2, (decoded or first)[-1], len(other) + len(decoded), 1, page_of=lambda pos: 8
                )
        kv = torch.stack([k[:6] for k, _ in runner.kv.layers])
        return out, decoded, kv

    whole, _, whole_kv = run([(0, num_layers)])
    grouped, decoded, grouped_kv = run([(0, 1), *((i, i + 1) for i in range(1, num_layers))])
    assert grouped.tokens == whole.tokens and len(decoded) == num_layers - 1
    torch.testing.assert_close(grouped_kv, whole_kv, rtol=1e-5, atol=1e-5)
    got, want = grouped.sequences[1].prompt_logprobs, whole.sequences[1].prompt_logprobs
    assert len(got) == len(want) == len(prompt) - 1
    assert all(g.token_id == w.token_id and abs(g.logprob - w.logprob) < 1e-4 for g, w in zip(got, want))


def test_a_layer_group_that_does_not_follow_the_one_the_shard_holds_fails_its_sequence(model):
    num_layers = len(model.layers)
    prompt = list(range(300, 320))
    runner = _runner(model)

    def group(entry, start, end):
        plan = _plan(entry)
        plan.layer_start, plan.layer_end = start, end
        return runner.step(plan)

    assert "after 0 layers" in group(_first(1, prompt, [0, 1, 2], emit=False), 1, 2).failures[1]
    assert "samples from a step that stops" in group(_first(1, prompt, [0, 1, 2]), 0, 1).failures[1]
    assert not group(_first(1, prompt, [0, 1, 2], emit=False), 0, 1).failures
    assert "after 1 layers" in group(_next(1, prompt, 0, emit=False), 0, 0).failures[1]  # a whole step
    assert not runner.table.held, "a failed sequence is forgotten"
    assert not group(_first(2, prompt, [0, 1, 2], emit=False), 0, 1).failures
    assert "other inputs" in group(_next(2, prompt[:-1], 0, emit=False), 1, 0).failures[2]
    out = group(_first(3, prompt, [0, 1, 2]), 0, num_layers + 1)
    assert f"layers 0 to {num_layers + 1}" in out.failures[3]


def test_a_verification_emits_the_accepted_proposals_and_the_tokens_of_plain_decode(model):
    """Proposals verified in one step: the right ones are accepted, the first wrong one is
    replaced by the target's token, and decoding goes on from the position the router names
    (the rejected positions are written again), with the tokens plain decode makes. A plan that
    goes on from outside the verified positions fails its sequence."""
    prompt = list(range(100, 111))  # 11 tokens: pages 0 and 1 hold 16 positions
    plain = _runner(model)
    first = plain.step(_plan(_first(1, prompt, [0, 1]))).tokens
    reference = first + _decode(plain, 1, first[0], len(prompt), 8, page_of=lambda pos: 2)

    runner = _runner(model)
    assert runner.step(_plan(_first(1, prompt, [0, 1]))).tokens == first
    wrong = (reference[4] + 1) % model.cfg.vocab_size
    entry = _next(1, [first[0]], len(prompt), [2])  # positions 11..15 and the page for 16..
    entry.proposals.extend([*reference[1:4], wrong])
    out = runner.step(_plan(entry))
    assert not out.failures, out.failures
    assert out.sequences[1].tokens == reference[1:5]  # 3 accepted + the target's
    # Every proposal accepted: 1 + k tokens.
    entry = _next(1, [reference[4]], len(prompt) + 4)
    entry.proposals.extend(reference[5:8])
    out = runner.step(_plan(entry))
    assert out.sequences[1].tokens == reference[5:9]
    # The router names where it goes on; a position past what the verification wrote fails.
    step = runner.step(_plan(_next(1, [reference[8]], len(prompt) + 9)))
    assert "holds" in step.failures[1] and not runner.table.held


def test_a_verification_rewinds_to_any_verified_position_and_refuses_bad_proposals(model):
    prompt = list(range(100, 111))
    runner = _runner(model)
    token = runner.step(_plan(_first(1, prompt, [0, 1]))).tokens[0]
    entry = _next(1, [token], len(prompt))
    entry.proposals.extend([1, 2, 3])
    assert not runner.step(_plan(entry)).failures
    # Positions 12..14 are the proposals': going on from 12 (the first rejected) is allowed.
    assert not runner.step(_plan(_next(1, [5], len(prompt) + 1))).failures
    assert runner.table.get(1).next_pos == len(prompt) + 2
    # Proposals where nothing is sampled, or past the pages: that sequence fails alone.
    silent, beyond = _next(1, [5], len(prompt) + 2, emit=False), _next(1, [5], len(prompt))
    silent.proposals.append(1)
    beyond.proposals.extend([1] * 5)  # positions 11..16: page 2 not given
    assert "proposes" in runner.step(_plan(silent)).failures[1]
    runner = _runner(model)
    runner.step(_plan(_first(1, prompt, [0, 1])))
    assert "does not cover" in runner.step(_plan(beyond)).failures[1]


def test_a_constrained_verification_masks_each_row_as_a_sampled_token_is(model):
    prompt = list(range(100, 111))
    plain = _runner(model)
    first = plain.step(_plan(_first(1, prompt, [0, 1]))).tokens
    reference = first + _decode(plain, 1, first[0], len(prompt), 3)
    size = mask_bytes(model.cfg.vocab_size)
    anything, only = b"\xff" * size, bytearray(size)
    forced = (reference[3] + 1) % model.cfg.vocab_size
    only[forced // 8] |= 1 << (forced % 8)

    runner = _runner(model)
    runner.step(_plan(_first(1, prompt, [0, 1])))
    entry = _next(1, [first[0]], len(prompt))
    entry.proposals.extend(reference[1:3])
    entry.allowed_tokens, entry.proposal_masks[:] = anything, [anything, bytes(only)]
    out = runner.step(_plan(entry))
    assert out.tokens == [*reference[1:3], forced]  # the last row's draw is the mask's only token
    missing = _next(1, [forced], len(prompt) + 3)
    missing.proposals.append(5)
    missing.allowed_tokens = anything
    assert "without a mask" in runner.step(_plan(missing)).failures[1]
