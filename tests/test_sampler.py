import pytest
import torch

from shardline.kernels.token_mask import mask_logits, packed_masks, unpack
from shardline.shard.sampler import SamplingParams, sample


def tokens(logits, params, positions) -> list[int]:
    return [draw.token for draw in sample(logits, params, positions)]


def test_greedy_is_argmax_and_degenerate_filters_are_greedy():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    best = logits.argmax(-1).tolist()
    assert tokens(logits, [SamplingParams()] * 6, list(range(6))) == best
    top1 = [SamplingParams(temperature=1.0, top_k=1, seed=i) for i in range(6)]
    assert tokens(logits, top1, list(range(6))) == best
    tiny_p = [SamplingParams(temperature=1.0, top_p=1e-6, seed=i) for i in range(6)]
    assert tokens(logits, tiny_p, list(range(6))) == best


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0, -2.0]])
    seen_k = {tokens(logits, [SamplingParams(temperature=5.0, top_k=2, seed=s)], [0])[0] for s in range(200)}
    assert seen_k == {0, 1}
    # probabilities at t=1: ~.66 .24 .09 ...; top_p .8 keeps the first two only
    seen_p = {tokens(logits, [SamplingParams(temperature=1.0, top_p=0.8, seed=s)], [0])[0] for s in range(300)}
    assert seen_p == {0, 1}


def test_seeded_draw_depends_on_seed_and_position_only():
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = tokens(logits[1:2], [p], [17])
    batched = tokens(logits, [SamplingParams(temperature=0.7, seed=9), p, SamplingParams()], [3, 17, 5])
    assert batched[1] == alone[0]
    draws = {tuple(tokens(logits, [SamplingParams(temperature=2.0, seed=s)] * 3, [0, 1, 2])) for s in range(20)}
    assert len(draws) > 1


def test_every_value_validation_accepts_samples_safely():
    torch.manual_seed(2)
    logits = torch.randn(4, 1000) * 5
    best = logits.argmax(-1).tolist()
    tiny = [1e-39, 1.4e-45, 1e-30, 1e-6]  # float32 denormals included: greedy, exactly
    assert tokens(logits, [SamplingParams(temperature=t, seed=2**64 - 1) for t in tiny], [0, 1, 2, 3]) == best
    tiny_p = [
        SamplingParams(temperature=1.0, top_p=p, top_k=2**32 - 1, seed=s)
        for s, p in enumerate([1.4e-45, 1e-30, 1e-6, 1e-3])
    ]
    assert tokens(logits, tiny_p, [0, 1, 2, 3]) == best
    huge = {tokens(logits[:1], [SamplingParams(temperature=3.4e38, seed=s)], [0])[0] for s in range(50)}
    assert len(huge) > 40  # a huge temperature is uniform over the vocabulary


def test_ties_at_a_tiny_temperature_are_broken_by_the_seed():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0]])
    seen = {tokens(logits, [SamplingParams(temperature=1e-39, seed=s)], [0])[0] for s in range(40)}
    assert seen == {1, 2}


def test_a_row_with_non_finite_logits_fails_alone():
    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    out = sample(logits, [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams()], [0, 0, 0])
    assert out[0].token == logits[0].argmax() and out[2].token == logits[2].argmax()
    assert out[1].token is None and "non-finite" in out[1].failure


@pytest.mark.parametrize("bad", [float("inf"), float("-inf")])
def test_an_infinite_logit_fails_its_row_and_finite_ones_that_overflow_a_sum_do_not(bad):
    logits = torch.randn(3, 50)
    logits[0, 3] = bad
    logits[2, 5] = logits[2, 9] = 3e38  # finite, though their sum is not
    out = sample(logits, [SamplingParams()] * 3, [0, 0, 0])
    assert out[0].token is None and "non-finite" in out[0].failure
    assert out[1].token == logits[1].argmax() and out[2].token == 5


def _packed(allowed: set[int], vocab: int) -> bytes:
    """As llguidance packs a mask: bit t % 8 of byte t / 8, whole 32-bit words."""
    out = bytearray(-(-vocab // 32) * 4)
    for t in allowed:
        out[t // 8] |= 1 << (t % 8)
    return bytes(out)


CPU = torch.device("cpu")


def test_a_packed_mask_unpacks_bit_by_bit_and_masks_the_same_in_torch_and_the_kernel(monkeypatch):
    allowed = {0, 7, 8, 31, 32, 99}
    packed = packed_masks([_packed(allowed, 100), _packed({5}, 100), _packed(set(range(100)), 100)], 100, CPU)
    masks = unpack(packed, 100)
    assert masks.shape == (3, 100) and set(masks[0].nonzero().flatten().tolist()) == allowed
    # llguidance's rows have a word more than the vocabulary needs: it is not read
    longer = packed_masks(
        [_packed(allowed, 100) + b"\xff" * 4, _packed({5}, 100), _packed(set(range(100)), 100)], 100, CPU
    )
    assert torch.equal(longer, packed)
    assert masks[1].nonzero().flatten().tolist() == [5] and bool(masks[2].all())
    logits = torch.randn(3, 100)
    ours = mask_logits(logits, packed)
    monkeypatch.setattr("shardline.kernels.token_mask.native.usable", lambda t: False)
    assert torch.equal(mask_logits(logits, packed), ours)
    assert torch.equal(torch.isinf(ours), ~masks) and torch.equal(ours[masks], logits[masks])


def test_a_masked_row_samples_only_allowed_tokens_and_its_neighbours_are_unchanged():
    torch.manual_seed(1)
    logits = torch.randn(3, 64)
    raw = logits.clone()
    allowed = {3, 17, 40}
    mask = packed_masks([_packed(allowed, 64)], 64, CPU)
    best_allowed = max(allowed, key=lambda t: logits[0, t])
    out = sample(logits, [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0)], [0, 0, 0], [0], mask)
    assert out[0].token == best_allowed != logits[0].argmax()
    assert out[1].token == logits[1].argmax()
    assert torch.equal(logits, raw), "the raw logits (what log-probabilities are of) stay as they were"
    seen = {sample(logits[:1], [SamplingParams(temperature=5.0, seed=s)], [0], [0], mask)[0].token for s in range(60)}
    assert seen == allowed


def test_a_mask_that_allows_nothing_fails_its_row_alone():
    logits = torch.randn(2, 40)
    nothing = packed_masks([bytes(8)], 40, CPU)
    out = sample(logits, [SamplingParams(), SamplingParams()], [0, 0], [0], nothing)
    assert out[0].token is None and "allows no token" in out[0].failure
    assert out[1].token == logits[1].argmax()
