"""The quality measure of quantized weights against dequantized ones, as llama.cpp reports it:
a text scored teacher-forced through `prompt_logprobs` by two servers; perplexity of each, mean KL
divergence, and the share of positions with the same top-1 (bench/quality.py; the quantized
serving paths' test).

The KL divergence is over the reference's TOP best tokens plus one bucket for the rest of the
vocabulary; where the other's top TOP lacks one of them, its probability is taken as its own
TOP-th best (an upper bound, which makes that term, and so the reported KL, an underestimate).
"""

from __future__ import annotations

import math

from shardline.protos import generation_pb2 as pb

TOP = 20


def reference_text() -> str:
    """English prose that every CPython ships: the reference documentation in
    `pydoc_data.topics`, sorted by topic and joined."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def prompt_scores(server, ids: list[int]) -> list[pb.TokenLogprob]:
    """Teacher-forced log-probabilities of ids[1:], with the best TOP alternatives each."""
    first = next(
        iter(
            server.stub.Generate(
                pb.GenerateRequest(
                    prompt_token_ids=pb.PromptTokens(ids=ids), max_new_tokens=1, ignore_eos=True, prompt_logprobs=TOP
                ),
                timeout=1800,
            )
        )
    )
    return list(first.prompt_logprobs)


def compare(reference: list[pb.TokenLogprob], other: list[pb.TokenLogprob]) -> dict:
    """Perplexities, mean KL(reference || other) over the reference's top TOP + rest, same top-1."""
    assert len(reference) == len(other) and reference
    kl, same = 0.0, 0
    for r, o in zip(reference, other):
        theirs = {t.token_id: t.logprob for t in o.top}
        floor = min(theirs.values())
        p = [math.exp(t.logprob) for t in r.top]
        q = [math.exp(theirs.get(t.token_id, floor)) for t in r.top]
        p_rest, q_rest = max(1.0 - sum(p), 1e-12), max(1.0 - sum(q), 1e-12)
        kl += sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q) if pi > 0)
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
        same += r.top[0].token_id == o.top[0].token_id
    n = len(reference)
    ppl = [math.exp(-sum(x.logprob for x in xs) / n) for xs in (reference, other)]
    return {
        "positions": n,
        "perplexity_reference": ppl[0],
        "perplexity": ppl[1],
        "perplexity_ratio": ppl[1] / ppl[0],
        "mean_kl": kl / n,
        "same_top1": same / n,
    }
