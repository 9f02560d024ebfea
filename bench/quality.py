"""Quality of native (quantized) weights against the dequantized ones, as llama.cpp reports it:
one fixed text scored teacher-forced through `prompt_logprobs` by a native and a dequantized
server; perplexity of each, mean KL divergence, and the share of positions with the same top-1.

The text is English prose that every CPython ships: the reference documentation in
`pydoc_data.topics` (sorted by topic, joined), cut to `--tokens` tokens. The KL divergence is over
the dequantized server's 20 best tokens plus one bucket for the rest of the vocabulary; where a
native server's top 20 lacks one of them, its probability is taken as its own 20th best (an upper
bound, which makes that term, and so the reported KL, an underestimate).

    python -m bench.quality [--tokens 4096]

Targets (the quantized-weights issue): perplexity within +1% of dequantized, same top-1 >= 97%.
"""
from __future__ import annotations

import argparse
import math

from bench.common import machine, save
from bench.serve import Serve
from protos import generation_pb2 as pb

TOP = 20


def reference_text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def prompt_scores(server, ids: list[int]) -> list[pb.TokenLogprob]:
    """Teacher-forced log-probabilities of ids[1:], with the best TOP alternatives each."""
    first = next(iter(server.stub.Generate(pb.GenerateRequest(
        prompt_token_ids=pb.PromptTokens(ids=ids), max_new_tokens=1, ignore_eos=True,
        prompt_logprobs=TOP), timeout=1800)))
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
    return {"positions": n, "perplexity_reference": ppl[0], "perplexity": ppl[1],
            "perplexity_ratio": ppl[1] / ppl[0], "mean_kl": kl / n, "same_top1": same / n}


def plot(result: dict, png) -> None:
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = ["dequantized", "native"]
    a1.bar(names, [result["perplexity_reference"], result["perplexity"]], color=["gray", "tab:blue"])
    a1.set_ylabel("perplexity")
    a1.set_title(f"{result['positions']} positions, ratio {result['perplexity_ratio']:.4f}")
    a2.bar(["same top-1"], [result["same_top1"] * 100], color="tab:blue")
    a2.axhline(97, ls="--", color="red", label="target 97%")
    a2.set_ylim(90, 100)
    a2.set_title(f"mean KL {result['mean_kl']:.4f}")
    a2.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()
    scores, result = {}, {"benchmark": "quality", **machine(), "model": args.model}
    for weights in ("dequantized", "native"):
        server = Serve("--model", args.model, "--weights", weights)
        try:
            if "ids" not in result:
                from router.tokenizer import TextCodec
                from common.model_source import resolve_model
                from common.tokenizer_files import tokenizer_folder
                codec = TextCodec(tokenizer_folder(resolve_model(args.model)))
                result["ids"] = codec.encode(reference_text())[:args.tokens]
            result[f"weight_formats_{weights}"] = dict(server.stub.Info(pb.InfoRequest()).weight_formats)
            scores[weights] = prompt_scores(server, result["ids"])
        finally:
            server.stop()
    result.update(compare(scores["dequantized"], scores["native"]))
    result["tokens"] = len(result.pop("ids"))
    print({k: v for k, v in result.items() if not k.startswith("weight_formats")})
    save("quality", result, plot)


if __name__ == "__main__":
    main()
