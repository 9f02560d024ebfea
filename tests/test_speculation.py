"""Speculative decoding's parts, each alone: the n-gram proposer, the policy that prices
proposals from measured step costs, and rejection sampling (the output distribution is the
target's: a chi-square test over many seeds of a tiny bigram model)."""

import itertools

import torch

from shardline.router.core.ngrams import Drafting
from shardline.router.core.sequence import Sampling, Sequence
from shardline.router.core.speculation import NGRAM, OFF, SUFFIX, Speculator, StepCosts
from shardline.router.core.suffixes import OutputCache, SuffixDrafting, continuation
from shardline.shard.sampler import SamplingParams, sample_row, verify


def test_the_longest_recent_suffix_proposes_what_followed_it():
    d = Drafting(most_tokens=4)
    text = [5, 6, 7, 8, 9, 1, 2, 6, 7, 3, 4, 5, 6, 7]
    # [5, 6, 7] occurred at the start (followed by 8, 9, 1, 2)
    prompt, output = text[:9], text[9:]
    assert d.propose(prompt, output, most=10) == [8, 9, 1, 2]
    assert d.propose(prompt, output, most=2) == [8, 9]
    assert d.propose(prompt, [*output, 3], most=10) == [4, 5, 6, 7]  # [6, 7, 3] after position 7
    assert Drafting(most_tokens=4).propose([1, 2, 3, 4], [], most=10) == []  # nothing repeats
    # Two tokens recur by chance in any text: too short a suffix to go by.
    assert Drafting(most_tokens=4).propose([1, 2, 9, 8], [1, 2], most=10) == []


def test_the_proposal_length_follows_acceptance():
    d = Drafting(most_tokens=8)
    assert d.k == 8
    d.verified(8, 3)  # rejected at the fourth
    assert d.k == 4 and d.proposed == 8 and d.accepted == 3
    d.verified(4, 4)  # all accepted: it grows back
    assert d.k == 8
    d.verified(8, 0)
    assert d.k == 1 and d.acceptance < 0.6
    low = d.acceptance
    d.not_sent()  # drifts back toward the prior
    assert low < d.acceptance < 0.6
    assert d.expected(4) < 4 * d.acceptance


def test_step_costs_interpolate_between_measured_row_counts():
    costs = StepCosts()
    assert costs.estimate(1) is None
    costs.add(1, 10.0)
    assert costs.estimate(1) == 10.0 and costs.estimate(5) is None
    costs.add(9, 26.0)
    assert costs.estimate(5) == 18.0 and costs.estimate(17) == 42.0
    costs.add(1, 20.0)  # a running average
    assert 10.0 < costs.estimate(1) < 20.0


def _decoding(seq_id: int, prompt: list[int], output: list[int], max_new: int = 100) -> Sequence:
    seq = Sequence(seq_id, str(seq_id), prompt, max_new, Sampling())
    seq.output_ids = list(output)
    return seq


def test_proposals_are_sent_where_the_measured_costs_say_they_pay():
    spec = Speculator(NGRAM, 4, max_position=1000)
    copying = _decoding(1, [1, 2, 3, 4, 5, 6, 7], [1, 2, 3])
    assert spec.propose([copying]) == {copying: [4, 5, 6, 7]}  # costs unknown: it tries
    first = Speculator(NGRAM, 4, max_position=1000)
    first.measured(1, 0.010, ahead=False)
    first.measured(5, 0.100, ahead=False)  # rows too dear, but a sequence's first proposal is tried
    assert first.propose([_decoding(9, [1, 2, 3, 4, 5, 6, 7], [1, 2, 3])])
    ngram = copying.drafting.each[0]
    copying.drafting.verified(4, 4)
    spec.measured(1, 0.010, ahead=False)
    spec.measured(5, 0.016, ahead=False)  # rows cost 1.5 ms each
    ngram.acceptance = 0.95
    assert spec.propose([copying]) == {copying: [4, 5, 6, 7]}
    ngram.acceptance = 0.55  # then only the first few are worth their rows
    assert spec.propose([copying])[copying] in ([4], [4, 5], [4, 5, 6])
    ngram.acceptance = 0.1  # and not even the first (by MARGIN)
    assert spec.propose([copying]) == {}
    ngram.acceptance = 0.55
    # Unless a step without proposals, sent ahead, costs less than that: its round trip overlaps.
    spec.measured(1, 0.006, ahead=True)
    assert spec.propose([copying]) == {}
    ngram.acceptance = 0.95
    spec.measured(5, 0.100, ahead=False)  # now they cost ten steps (a running average: measure it again)
    spec.measured(5, 0.100, ahead=False)
    spec.measured(5, 0.100, ahead=False)
    assert spec.propose([copying]) == {}
    # Never past the request's limit: one token of room is the target's own.
    near_end = _decoding(2, [1, 2, 3, 4, 5, 6, 7], [1, 2, 3], max_new=5)
    assert spec.propose([near_end], trial=True) in ({near_end: [4]}, {})
    assert len(Speculator(NGRAM, 4, 1000).propose([near_end])[near_end]) == 1
    opted_out = _decoding(3, [1, 2, 3, 4], [1, 2])
    opted_out.speculative = False
    assert Speculator(NGRAM, 4, 1000).propose([opted_out]) == {}
    assert Speculator(OFF, 4, 1000).propose([_decoding(4, [1, 2, 3, 4], [1, 2])]) == {}


def test_a_suffix_proposes_what_most_often_followed_its_longest_match():
    # [0, 1, 2, 3] went on with 4, 5, 6, 0 twice and with 4, 5, 6, 8 once, the latest: frequency
    # wins where prompt lookup takes the latest occurrence; 4 tokens matched, 4 proposed.
    text = [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 8, 1, 2, 3, 9, 0, 1, 2, 3]
    assert SuffixDrafting(8).propose(text, [], 8) == [4, 5, 6, 0]
    assert Drafting(8).propose(text, [], 8)[:4] == [4, 5, 6, 8]
    # A longer match earns a longer proposal, and outranks more frequent shorter ones.
    code = [7, 8, 1, 2, 3, 4, 5, 6, 10, 11, 12, 13, 1, 2, 3, 9]
    assert continuation([*code, 7, 8, 1, 2, 3], [(code, 5), (code, 15)], 8) == [4, 5, 6, 10, 11]  # 5 matched
    # Continuations that scatter fall below MIN_PROBABILITY and are not proposed.
    scattered = [tok for nxt in range(20, 40) for tok in (1, 2, 3, nxt)]
    assert SuffixDrafting(8).propose(scattered, [1, 2, 3], 8) == []
    assert SuffixDrafting(8).propose([1, 2, 3, 4], [], 8) == []  # nothing recurs


def test_earlier_outputs_propose_within_their_namespace_and_the_oldest_go_first():
    cache = OutputCache(budget=40)
    answer = list(range(100, 130))
    cache.add("tenant-a", answer)
    prompt = [1, 2, 3, *answer[:5]]  # its prompt does not hold the rest of the answer
    # 5 tokens matched (100..104): 5 proposed
    assert SuffixDrafting(8, cache=cache, namespace="tenant-a").propose(prompt, [], 8) == answer[5:10]
    assert SuffixDrafting(8, cache=cache, namespace="tenant-b").propose(prompt, [], 8) == []
    cache.add("tenant-b", list(range(200, 220)))  # 50 tokens kept over a budget of 40: the first goes
    assert len(cache) == 1 and cache.tokens == 20
    assert SuffixDrafting(8, cache=cache, namespace="tenant-a").propose(prompt, [], 8) == []
    assert all(key[0] == "tenant-b" for key in cache._index), "an evicted text left index entries"


def test_suffix_mode_learns_from_finished_requests_and_credits_the_proposer_it_sent():
    spec = Speculator(SUFFIX, 8, max_position=1000)
    first = _decoding(1, [1, 2, 3], list(range(40, 60)))
    spec.finished(first)
    again = _decoding(2, [5, 6, 7], list(range(40, 48)))  # writes what the first wrote
    assert spec.propose([again]) == {again: list(range(48, 56))}
    suffix, ngram = again.drafting.each
    assert again.drafting.sent is suffix
    again.drafting.verified(8, 8)
    assert (suffix.accepted, ngram.accepted, again.drafting.accepted) == (8, 0, 8)
    # Where both propose the same, the suffix proposer's better record keeps it chosen; prompt
    # lookup takes over for a sequence where only it proposes.
    looking_up = _decoding(3, [9, 8, 7, 6, 9, 8, 7], [], max_new=10)
    assert spec.propose([looking_up]) == {looking_up: [6, 9, 8, 7]}
    assert looking_up.drafting.sent is not None
    opted_out = _decoding(4, [1, 2, 3], [9, 9, 9, 9, 9])
    opted_out.speculative = False
    spec.finished(opted_out)  # a request that opted out is not kept either
    assert len(spec.outputs) == 1


def test_greedy_verification_keeps_the_proposals_the_target_agrees_with():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 8, 2]):
        logits[row, best] = 1.0
    greedy = SamplingParams()
    assert verify(logits, [3, 5, 8], greedy, 10) == [3, 5, 8, 2]  # all accepted, then the target's
    assert verify(logits, [3, 6, 8], greedy, 10) == [3, 5]  # the second rejected: the target's there
    assert verify(logits, [0, 5, 8], greedy, 10) == [3]


# A tiny bigram model: the logits of the next token given the one before.
VOCAB = 5
BIGRAM = torch.tensor(
    [
        [2.0, 0.5, 0.1, -1.0, 0.3],
        [0.1, 1.5, 1.4, 0.2, -0.5],
        [0.0, 0.0, 0.0, 0.0, 0.0],
        [-2.0, 3.0, 0.5, 0.5, 1.0],
        [0.7, -0.3, 2.2, 0.1, 0.9],
    ]
)
START, SEEDS = 3, 6000
PARAMS = dict(temperature=0.9, top_k=4)


def _two_tokens(seed: int, verifier) -> tuple[int, int]:
    """The first two tokens after START, drawn with speculation: the proposer always proposes
    [1, 2] (often wrong), and each verification's rows are the bigram logits of their inputs."""
    p = SamplingParams(seed=seed, **PARAMS)
    out = []
    while len(out) < 2:
        proposals = [1, 2]
        inputs = [out[-1] if out else START, *proposals]
        out += verifier(BIGRAM[inputs], proposals, p, len(out))
    return out[0], out[1]


def _chi_square(counts: dict, expected: dict, n: int) -> float:
    return sum((counts.get(cell, 0) - n * q) ** 2 / (n * q) for cell, q in expected.items() if q > 0)


def _target_pairs() -> dict:
    """The target's distribution of the first two tokens, exactly (temperature, top-k)."""

    def probs(prev):
        logits = BIGRAM[prev] / PARAMS["temperature"]
        kth = logits.topk(PARAMS["top_k"]).values[-1]
        return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), -1)

    first = probs(START)
    return {(a, b): float(first[a] * probs(a)[b]) for a, b in itertools.product(range(VOCAB), repeat=2)}


def _accept_everything(logits, proposals, p, position):
    return [*proposals, sample_row(logits[len(proposals)], p, position + len(proposals))]


def test_rejection_sampling_draws_what_the_target_draws():
    expected = _target_pairs()
    bound = 52.24  # chi-square, 16 degrees of freedom (the 17 pairs top-k leaves), p = 1e-5

    def statistic(verifier) -> float:
        counts: dict = {}
        for seed in range(SEEDS):
            pair = _two_tokens(seed, verifier)
            counts[pair] = counts.get(pair, 0) + 1
        assert all(expected[pair] > 0 for pair in counts), "a token top-k excludes was drawn"
        return _chi_square(counts, expected, SEEDS)

    assert statistic(verify) < bound
    # The same test fails a verifier that accepts every proposal (it draws [1, 2] every time).
    assert statistic(_accept_everything) > 10 * bound


def test_a_seed_gives_the_same_verified_tokens_every_time():
    p = SamplingParams(temperature=1.0, seed=7)
    rows = BIGRAM[[0, 1, 2, 3]]
    assert verify(rows, [1, 2, 3], p, 40) == verify(rows.clone(), [1, 2, 3], p, 40)
