"""Quality of native (quantized) weights against the dequantized ones, as llama.cpp reports it:
one fixed text scored teacher-forced through `prompt_logprobs` by a native and a dequantized
server; perplexity of each, mean KL divergence, and the share of positions with the same top-1.

The text is English prose that every CPython ships: the reference documentation in
`pydoc_data.topics` (sorted by topic, joined), cut to `--tokens` tokens. harness/quality.py says how
the KL divergence is taken.

    python -m bench.quality [--tokens 4096]

Targets (the quantized-weights issue): perplexity within +1% of dequantized, same top-1 >= 97%.
"""
from __future__ import annotations

import argparse

from bench.common import machine, save
from harness.quality import compare, prompt_scores, reference_text
from harness.serve import Server
from protos import generation_pb2 as pb


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
        server = Server("--model", args.model, "--weights", weights)
        try:
            if "ids" not in result:
                from router.tokenizer import TextCodec
                from common.model_source import resolve_model
                from router.tokenizer_files import tokenizer_folder
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
