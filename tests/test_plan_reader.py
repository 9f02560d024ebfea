"""The shard's reader of plan entries (shard/plan_reader.py): every rule turns away the entry it
names, with its own message, a good entry reads as the runner computes it, and reading leaves the
plan as it came."""

import pytest
import torch

from shardline.kernels.token_mask import mask_bytes
from shardline.protos import shard_pb2
from shardline.shard.plan_reader import RULES, Context, Entry, plan_layers, read
from shardline.shard.sampler import SamplingParams
from shardline.shard.sequences import SequenceState

VOCAB = 100
AT = Context(
    layer_start=0,
    finishing=True,
    vocab_size=VOCAB,
    max_position=64,
    page_size=8,
    max_pages=8,
    num_pages=16,
    held=1,
    has_room=True,
    long_rope=True,
)
MASK = bytes(mask_bytes(VOCAB))


def _held(next_pos=10, sampled=7, pages=(0, 1)) -> SequenceState:
    return SequenceState(row=0, pages=list(pages), sampling=SamplingParams(), next_pos=next_pos, sampled=sampled)


def _new(**fields) -> shard_pb2.SequenceStep:
    base = dict(seq_id=1, first=True, token_ids=[1, 2], start_pos=0, new_pages=[0], emit=True)
    return shard_pb2.SequenceStep(**{**base, **fields})


def _next(**fields) -> shard_pb2.SequenceStep:
    return shard_pb2.SequenceStep(**{**dict(seq_id=1, token_ids=[3], start_pos=10, emit=True), **fields})


def _state(held: str) -> SequenceState | None:
    """What the shard holds for the sequence: nothing, or its state after 10 positions (having
    sampled a token, or not, or part way through a chunk's layers)."""
    if held == "partial":
        return SequenceState(0, [0, 1], SamplingParams(), 10, partial=torch.zeros(2, 4), partial_layers=4)
    return {"new": None, "held": _held(), "sampled none": _held(sampled=None)}[held]


NEW, HELD = "new", "held"
CASES = [  # (entry, what the shard holds, context changes, phrase)
    (_next(emit=False), HELD, dict(layer_start=4, finishing=False), "holds it after 0 layers"),
    (_next(emit=False), "partial", dict(layer_start=4, finishing=False), "continues a chunk of 2 tokens"),
    (_next(emit=True), HELD, dict(finishing=False), "stops before the last layer"),
    (_new(), HELD, {}, "already holds it"),
    (_next(), NEW, {}, "does not hold"),
    (_next(start_pos=12), HELD, {}, "holds 10 positions"),
    (_next(sampled_input=True), HELD, {}, "gives input tokens and asks for the sampled one"),
    (_next(token_ids=[], sampled_input=True), "sampled none", {}, "sampled none here"),
    (_next(proposals=[4], emit=False), HELD, {}, "does not sample from its last input"),
    (_next(proposal_masks=[MASK]), HELD, {}, "1 proposal masks for 0 proposals"),
    (_next(proposals=[4], allowed_tokens=MASK), HELD, {}, "without a mask for each"),
    (_next(allowed_tokens=MASK[:-4]), HELD, {}, "a token mask of"),
    (_next(token_ids=[]), HELD, {}, "no input tokens"),
    (_next(start_pos=10, token_ids=[3], proposals=[4] * 60), HELD, {}, "exceed the model's context"),
    (_next(start_pos=10, token_ids=[3] * 7), HELD, {}, "does not cover 17 positions"),
    (_new(new_pages=[16]), NEW, {}, "outside the pool of 16 pages"),
    (_new(new_window_pages=[0]), NEW, {}, "has no window pool"),
    (_new(), NEW, dict(window_pages=4), "0 window pages for 1 new pages"),
    (_new(new_window_pages=[5]), NEW, dict(window_pages=4), "outside the window pool of 4 pages"),
    (_next(token_ids=[VOCAB]), HELD, {}, f"token id {VOCAB} outside"),
    (_next(prompt_logprobs=21), HELD, {}, "at most 20 alternatives"),
    (_new(long_rope=True), NEW, dict(long_rope=False), "which the model has none of"),
    (_next(long_rope=True), HELD, {}, "long rotary factors after its first step"),
    (_new(sampling=shard_pb2.Sampling(temperature=-1)), NEW, {}, "invalid sampling parameters"),
    (_new(), NEW, dict(has_room=False), "holds 1 sequences, its maximum"),
]


@pytest.mark.parametrize(("entry", "held", "changes", "phrase"), CASES, ids=[c[3] for c in CASES])
def test_each_rule_turns_away_its_entry(entry, held, changes, phrase):
    why = read(entry, _state(held), Context(**{**AT.__dict__, **changes}))
    assert isinstance(why, str) and phrase in why, why


def test_every_rule_has_a_case():
    """Each rule turns away at least one case above that no rule before it does."""
    fired = set()
    for entry, held, changes, _ in CASES:
        state, at = _state(held), Context(**{**AT.__dict__, **changes})
        fired.add(next(rule.__name__ for rule in RULES if rule(entry, state, at)))
    assert fired == {rule.__name__ for rule in RULES}


def test_a_good_entry_reads_as_it_is_computed_and_the_plan_stays_as_it_came():
    entry = _next(token_ids=[], sampled_input=True, start_pos=10, new_pages=[2])
    sent = entry.SerializeToString()
    got = read(entry, _held(sampled=7), AT)
    assert isinstance(got, Entry) and got.inputs == (7,) and got.new_pages == (2,) and not got.first
    with_proposals = _next(proposals=[4, 5], new_pages=[2])
    got = read(with_proposals, _held(), AT)
    assert got.tokens == (3, 4, 5) and got.sampling is None
    first = read(_new(sampling=shard_pb2.Sampling(temperature=0.5, seed=3, logprobs=0)), None, AT)
    assert first.first and first.sampling == SamplingParams(0.5, 1.0, 0, 3, 0) and first.prompt_logprobs is None
    assert entry.SerializeToString() == sent and list(with_proposals.token_ids) == [3]


def test_the_runner_leaves_its_plan_as_it_came(tiny_models):
    """runner.step reads entries through the reader; the plan it was handed is not changed."""
    from shardline.common.model_source import resolve_model
    from shardline.shard.runner import ModelRunner
    from shardline.shard.weights import build_model

    model = build_model(resolve_model(str(tiny_models["qwen3"])), torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, 8, torch.float32, torch.device("cpu"))
    runner.allocate(8, 2)
    runner.step(shard_pb2.StepPlan(seqs=[_new(token_ids=[1, 2, 3], new_pages=[0, 1])]))
    for entry in (
        _next(token_ids=[], sampled_input=True, start_pos=3),
        _next(token_ids=[9], start_pos=4, proposals=[4]),
    ):
        plan = shard_pb2.StepPlan(seqs=[entry])
        sent = plan.SerializeToString()
        out = runner.step(plan)
        assert not out.failures and plan.SerializeToString() == sent


@pytest.mark.parametrize(
    ("start", "end", "stages", "phrase"),
    [
        (0, 0, 1, None),  # every layer
        (0, 2, 1, None),  # a layer group
        (2, 0, 1, None),  # the last group
        (0, 2, 2, "on a pipeline stage"),
        (3, 2, 1, "layers 3 to 2 of 4"),
        (0, 5, 1, "layers 0 to 5 of 4"),
    ],
)
def test_a_plans_layers_are_read_or_turned_away(start, end, stages, phrase):
    layers, why = plan_layers(shard_pb2.StepPlan(layer_start=start, layer_end=end), 4, stages)
    assert layers == slice(start, end or 4)
    assert why is None if phrase is None else phrase in why
