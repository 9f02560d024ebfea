"""A decode row computes the same numbers whatever else its step holds: SmolLM2's GGUF in process,
on the quantized kernels a CPU shard serves it with.

Those kernels quantize each row's activations to int8, so a difference in the last bit of an
activation can move a rounding and the logits by far more than float noise: a step that splits
a sequence's attention by how many rows it holds, or that verifies proposals on another path
than decode, changes greedy tokens at near-ties. Speculation promises the same greedy text on
and off, and a request the same text whether it decodes alone or beside others; these tests
hold the shard to that, bit for bit.
"""

import pytest
import torch

import shardline.shard.runner as runner_module
from shardline.protos import shard_pb2
from shardline.shard.runner import ModelRunner

# A prompt that repeats (so that its continuation does, as copied text would be proposed) and long
# enough to fill more than one 64-token page.
PROMPT = [1, 504, 3458, 282, 253, 1345, 30, 506, 2744, 314, 3227, 28, 1345, 30, 506, 2744, 314, 3227, 28] * 4
PAGES = 8  # per sequence: PROMPT and what follows it fit


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    from shardline.cli import build_parser
    from shardline.shard.load import load_shard

    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))  # load_shard sets it
    shard = load_shard(build_parser().parse_args(["shard", "--model", "smollm2", "--listen", "unix:/unused"]))
    if shard.keep is not None:  # the served cache's writer: finished before the test, not beside it
        shard.keep.start()
        shard.keep.join()
    yield shard
    mp.undo()


def _runner(shard) -> ModelRunner:
    runner = ModelRunner(shard.model, 64, shard.kv_dtype, shard.device)
    runner.allocate(4 * PAGES + 1, 4)
    return runner


def _start(runner, seq_id: int) -> tuple[int, float]:
    pages = list(range(1 + seq_id * PAGES, 1 + (seq_id + 1) * PAGES))
    sampling = shard_pb2.Sampling(temperature=0.0, top_p=1.0, logprobs=0)
    entry = shard_pb2.SequenceStep(
        seq_id=seq_id, first=True, token_ids=PROMPT, start_pos=0, new_pages=pages, emit=True, sampling=sampling
    )
    out = runner.step(shard_pb2.StepPlan(seqs=[entry]))
    (made,) = out.sequences.values()
    return made.tokens[0], made.sampled_logprobs[0].logprob


def _decode(runner, seq_ids: list[int], tokens: dict[int, int], pos: int) -> dict[int, tuple[int, float]]:
    """One decode step of `seq_ids` at `pos`: each one's (token, its log-probability)."""
    entries = [shard_pb2.SequenceStep(seq_id=i, token_ids=[tokens[i]], start_pos=pos, emit=True) for i in seq_ids]
    out = runner.step(shard_pb2.StepPlan(seqs=entries))
    assert not out.failures, out.failures
    return {i: (out.sequences[i].tokens[0], out.sequences[i].sampled_logprobs[0].logprob) for i in seq_ids}


def _alone(shard, steps: int) -> list[tuple[int, float]]:
    """Sequence 0 decoded by itself, a token a step: its (token, log-probability) after the prompt."""
    runner = _runner(shard)
    got = [_start(runner, 0)]
    for t in range(steps):
        got.append(_decode(runner, [0], {0: got[-1][0]}, len(PROMPT) + t)[0])
    return got


@torch.inference_mode()
def test_a_verification_computes_each_row_as_a_decode_step_does(shard, monkeypatch):
    """Proposals of 8 tokens verified in one step: every row's log-probability equals plain
    decode's to the bit, also where the context is long enough that a prefill of those rows
    would take the prefill path's attention (here every context, by the limit set to 0)."""
    for limit in (runner_module.ROWS_ATTENTION_PAIRS, 0):  # 0: the prompt, too, on the prefill path
        monkeypatch.setattr(runner_module, "ROWS_ATTENTION_PAIRS", limit)
        reference = _alone(shard, 17)
        tokens = [t for t, _ in reference]
        assert len(set(tokens)) > 3, tokens  # a continuation worth proposing, not one token repeated
        runner = _runner(shard)
        assert _start(runner, 0) == reference[0]
        for at in (0, 8):  # inputs tokens[at], proposals the 8 after it: all accepted
            entry = shard_pb2.SequenceStep(seq_id=0, token_ids=[tokens[at]], start_pos=len(PROMPT) + at, emit=True)
            entry.proposals.extend(tokens[at + 1 : at + 9])
            out = runner.step(shard_pb2.StepPlan(seqs=[entry]))
            assert out.sequences[0].tokens == tokens[at + 1 : at + 10], (limit, at, out)
            got = [lp.logprob for lp in out.sequences[0].sampled_logprobs]
            assert got == [lp for _, lp in reference[at + 1 : at + 10]], (limit, at)


@torch.inference_mode()
def test_a_sequence_decodes_the_same_numbers_beside_others_as_alone(shard):
    """Sequence 0 in a step of three computes what it computes alone: the attention splits a
    context by its length, not by how many rows share the step's threads."""
    reference = _alone(shard, 6)
    runner = _runner(shard)
    first = {i: _start(runner, i)[0] for i in range(3)}
    assert first[0] == reference[0][0]
    tokens, pos = dict(first), len(PROMPT)
    for t in range(6):
        got = _decode(runner, [0, 1, 2], tokens, pos + t)
        assert got[0] == reference[t + 1], t
        tokens = {i: got[i][0] for i in got}
