"""Quality of native (quantized) weights against the dequantized ones, as llama.cpp reports it:
one fixed text scored teacher-forced through `prompt_logprobs` by a native and a dequantized
server; perplexity of each, mean KL divergence, and the share of positions with the same top-1.

The text is English prose that every CPython ships: the reference documentation in
`pydoc_data.topics` (sorted by topic, joined), cut to `--tokens` tokens. harness/quality.py says how
the KL divergence is taken.

    python -m bench.quality [--tokens 4096] [--model smollm2] [--chunk-size 16]

The native server scores the text in chunks of `--chunk-size` tokens, so that its rows take the
path decode's take (straight from the codes, activations rounded to int8 per group of 32) rather
than prefill's GEMM on dequantized slices (0: whole prompts, prefill's path).

llama.cpp (`llama-cpp-python`, the optional `peers` extra) scores the same tokens of the same GGUF
in the same run, so its own agreement with the dequantized weights is measured beside ours.
Targets: perplexity within +0.5% of dequantized, and same top-1 at least llama.cpp's own agreement
on this text (97% where llama.cpp is not installed).
"""

from __future__ import annotations

import argparse

from bench.common import llama_cpp_model, machine, save
from harness.quality import TOP, compare, prompt_scores, reference_text
from harness.serve import Server
from shardline.protos import generation_pb2 as pb


def llama_cpp_scores(model: str, ids: list[int]) -> list[pb.TokenLogprob] | None:
    """llama.cpp's teacher-forced log-probabilities of ids[1:] on the model's GGUF, as
    `prompt_scores` gives a server's; None without llama-cpp-python."""
    llm = llama_cpp_model(model, len(ids) + 8, n_batch=512, logits_all=True)
    if llm is None:
        return None
    import numpy as np

    llm.eval(ids)
    out = []
    for i in range(len(ids) - 1):
        row = np.asarray(llm.scores[i], dtype=np.float64)
        logp = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        best = np.argpartition(-logp, TOP)[:TOP]
        best = best[np.argsort(-logp[best])]
        out.append(
            pb.TokenLogprob(
                token_id=ids[i + 1],
                logprob=float(logp[ids[i + 1]]),
                top=[pb.TopLogprob(token_id=int(t), logprob=float(logp[t])) for t in best],
            )
        )
    del llm
    return out


def plot(result: dict, png) -> None:
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = ["dequantized", "native"]
    a1.bar(names, [result["perplexity_reference"], result["perplexity"]], color=["gray", "tab:blue"])
    a1.set_ylabel("perplexity")
    a1.set_title(f"{result['positions']} positions, ratio {result['perplexity_ratio']:.4f}")
    a2.bar(["Shardline native"], [result["same_top1"] * 100], color="tab:blue")
    if "llama_cpp" in result:
        a2.bar(["llama.cpp"], [result["llama_cpp"]["same_top1"] * 100], color="tab:green")
    a2.axhline(result["gate"]["same_top1_at_least"] * 100, ls="--", color="red", label="gate")
    a2.set_ylabel("same top-1 as dequantized, %")
    a2.set_ylim(90, 100)
    a2.set_title(f"mean KL {result['mean_kl']:.4f}")
    a2.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--chunk-size", type=int, default=16)
    args = parser.parse_args()
    scores, result = {}, {"benchmark": "quality", **machine(), "model": args.model, "chunk_size": args.chunk_size}
    for weights in ("dequantized", "native"):
        chunks = ("--chunk-size", str(args.chunk_size)) if weights == "native" else ()
        server = Server("--model", args.model, "--weights", weights, *chunks)
        try:
            if "ids" not in result:
                from shardline.common.model_source import resolve_model
                from shardline.common.tokenizer import TextCodec
                from shardline.common.tokenizer_files import tokenizer_folder

                codec = TextCodec(tokenizer_folder(resolve_model(args.model)))
                result["ids"] = codec.encode(reference_text())[: args.tokens]
            result[f"weight_formats_{weights}"] = dict(server.stub.Info(pb.InfoRequest()).weight_formats)
            scores[weights] = prompt_scores(server, result["ids"])
        finally:
            server.stop()
    result.update(compare(scores["dequantized"], scores["native"]))
    theirs = llama_cpp_scores(args.model, result["ids"])
    if theirs is not None:
        result["llama_cpp"] = compare(scores["dequantized"], theirs)
    gate = result.get("llama_cpp", {}).get("same_top1", 0.97)
    result["gate"] = {
        "same_top1_at_least": gate,
        "perplexity_ratio_at_most": 1.005,
        "passed": result["same_top1"] >= gate and result["perplexity_ratio"] <= 1.005,
    }
    result["tokens"] = len(result.pop("ids"))
    print({k: v for k, v in result.items() if not k.startswith("weight_formats")})
    save("quality", result, plot)


if __name__ == "__main__":
    main()
