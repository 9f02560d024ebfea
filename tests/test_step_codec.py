"""The codec between the router's steps and shard.proto (router/shards/codec.py): every field of
the answers it reads has a home in the core's types, a plan carries what the sequence asked for,
and a step result's flat token list comes back as one result per sequence, or as the group's
failure when it does not add up; what the shard writes (shard/server.py), the codec reads back
per sequence."""

import pytest

from shardline.protos import shard_pb2
from shardline.router.core.sequence import Sampling, Sequence
from shardline.router.core.shards import ShardError, ShardInfo, Warmup
from shardline.router.core.step import Phase, Scheduled, Step
from shardline.router.shards.codec import Told, info_of, outcome_of, plan_of, warmup_of


@pytest.mark.parametrize(("plain", "message"), [(ShardInfo, shard_pb2.ShardInfo), (Warmup, shard_pb2.WarmupResponse)])
def test_every_field_of_the_answers_has_a_home_in_the_core(plain, message):
    assert set(plain.__dataclass_fields__) == set(message.DESCRIPTOR.fields_by_name)


def test_answers_read_as_plain_values():
    info = info_of(shard_pb2.ShardInfo(model="m", eos_token_ids=[2, 7], weight_formats={"wo": "int4"}, tp_size=2))
    assert (info.model, info.eos_token_ids, info.weight_formats, info.tp_size) == ("m", (2, 7), {"wo": "int4"}, 2)
    assert warmup_of(shard_pb2.WarmupResponse(decode_graph_buckets=[1, 4])).decode_graph_buckets == (1, 4)


def _seq(seq_id: int, sampling: Sampling | None = None, pages=(3, 4)) -> Sequence:
    seq = Sequence(seq_id, str(seq_id), list(range(8)), 4, sampling or Sampling())
    seq.pages.block_table = list(pages)
    return seq


def test_a_sequence_is_announced_once_with_its_sampling_and_released_once():
    told, seq = Told(), _seq(1, Sampling(temperature=0.5, top_p=0.9, top_k=4, seed=11, logprobs=0))
    first = plan_of(1, Step(Phase.ADMIT, [Scheduled(seq, seq.prompt_ids, True, False)]), told).seqs[0]
    assert first.first and list(first.new_pages) == [3, 4] and first.HasField("sampling")
    s = first.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.logprobs) == (0.5, pytest.approx(0.9), 4, 11, 0)
    assert s.HasField("logprobs"), "logprobs 0 (the sampled token alone) is not 'none'"

    seq.pages.block_table.append(9)
    seq.num_computed = 8
    later = plan_of(2, Step(Phase.DECODE, [Scheduled(seq, [5], True, True)]), told).seqs[0]
    assert not later.first and not later.HasField("sampling") and list(later.new_pages) == [9]
    assert later.start_pos == 8

    told.release(1)
    told.release(1)  # a failure and a finish: told once
    assert list(plan_of(3, Step(Phase.DECODE), told).released) == [1]
    assert not plan_of(4, Step(Phase.DECODE), told).released


def test_a_sequence_without_logprobs_asks_for_none():
    plan = plan_of(1, Step(Phase.ADMIT, [Scheduled(_seq(1), [1, 2], True, False)]), Told())
    assert not plan.seqs[0].sampling.HasField("logprobs")


def _step():
    a, b, c = _seq(1), _seq(2), _seq(3)
    return Step(
        Phase.DECODE,
        [Scheduled(a, [5], True, True, proposals=[6, 7]), Scheduled(b, [5], True, True), Scheduled(c, [5], True, True)],
    )


def test_a_result_comes_back_as_one_record_per_sequence():
    step = _step()
    result = shard_pb2.StepResult(
        step_id=1,
        tokens=[6, 8, 9],  # a accepted one proposal and drew 8; b failed; c drew 9
        token_counts=[2, 1],
        failures=[shard_pb2.SequenceFailure(seq_id=2, message="page id 999 outside the pool")],
        logprobs=[shard_pb2.SequenceLogprobs(seq_id=3, sampled=[shard_pb2.TokenLogprob(token_id=9, logprob=-0.5)])],
        compute_ms=3.0,
    )
    out = outcome_of(step, result)
    assert out.rows[1].tokens == (6, 8) and out.rows[3].tokens == (9,)
    assert out.rows[2].tokens == () and "outside the pool" in out.rows[2].failure
    assert out.rows[3].sampled_scores[0].token_id == 9 and not out.rows[1].sampled_scores
    assert out.failures == 1 and out.compute_ms == 3.0


@pytest.mark.parametrize(
    ("tokens", "counts", "failed", "phrase"),
    [
        ([6, 8, 9, 1], [2, 1], True, "4 tokens for 2 emitting"),  # a token too many
        ([6, 8], [1, 1], False, "2 tokens for 3 emitting"),  # a count per emitting sequence
        ([6, 7, 8, 9, 1], [4, 1], True, "4 tokens for a sequence of 2 proposals"),
        ([6, 8, 9], [], True, "3 tokens for 2 emitting"),  # no counts: one each
    ],
)
def test_a_result_that_does_not_add_up_fails_the_group(tokens, counts, failed, phrase):
    failures = [shard_pb2.SequenceFailure(seq_id=2, message="x")] if failed else []
    result = shard_pb2.StepResult(step_id=1, tokens=tokens, token_counts=counts, failures=failures)
    with pytest.raises(ShardError, match=phrase):
        outcome_of(_step(), result)


@pytest.mark.parametrize("accepted", [0, 1])
def test_what_the_shard_writes_the_router_reads_back_per_sequence(accepted):
    """shard/server.py's `step_result` over the runner's per-sequence output, read by the codec:
    each sequence's own tokens and log-probabilities, whether or not a count is written (none
    where every sequence has one token)."""
    from shardline.shard.runner import SequenceOutput, StepOutput
    from shardline.shard.server import step_result

    a_tokens = [6, 8][1 - accepted :]  # a verifies proposals 6, 7: one accepted, or none
    out = StepOutput(
        sequences={
            1: SequenceOutput(tokens=a_tokens),
            3: SequenceOutput(tokens=[9], sampled_logprobs=[shard_pb2.TokenLogprob(token_id=9, logprob=-0.5)]),
        },
        failures={2: "page id 999 outside the pool"},
    )
    result = step_result(1, out, 3.0)
    assert bool(result.token_counts) == bool(accepted)
    rows = outcome_of(_step(), result).rows
    assert rows[1].tokens == tuple(a_tokens) and rows[3].tokens == (9,) and rows[2].failure
    assert rows[3].sampled_scores[0].logprob == -0.5 and not rows[1].sampled_scores
