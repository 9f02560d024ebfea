"""SmolLM2 as a mixture of experts, to measure what quantized experts cost in quality on a model
that says something: every layer's MLP becomes 4 experts, each the MLP with its units in another
order (the same function, but other weights share each quantization block, so each expert's
blocks round differently), a random router picks 2 per token and their weights are renormalized
to sum to 1, so the dense model is what the mixture computes, whichever experts a token takes.
Written as a Mixtral-style GGUF (llama with experts; F32, from the weights Shardline serves for
SmolLM2), then quantized by llama.cpp's `llama-quantize`.

    python -m bench.upcycled --out DIR [--type Q4_K_M] [--llama-quantize PATH]
    python -m bench.quality --model DIR/smollm2-moe-Q4_K_M.gguf

What it cannot measure: routing under quantization (any pick gives the same function here).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from harness.gguf_of import write_gguf_of
from harness.reference import write_hf_config
from shardline.common.model_source import resolve_model
from shardline.shard.weights import load_state_dict

EXPERTS, PER_TOKEN = 4, 2


def upcycled_checkpoint(folder: Path, seed: int = 0) -> Path:
    """SmolLM2's weights as a Mixtral checkpoint (config.json + model.safetensors) in `folder`."""
    cfg, sd = load_state_dict(resolve_model(None))
    rng = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in sd.items():
        if ".mlp." not in name:
            out[name] = w.float().contiguous()
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        gate, up, down = (sd[f"{p}mlp.{k}_proj.weight"].float() for k in ("gate", "up", "down"))
        moe = f"{p}block_sparse_moe."
        out[moe + "gate.weight"] = torch.randn(EXPERTS, cfg.hidden_size, generator=rng) * 0.05
        for e in range(EXPERTS):
            order = torch.randperm(cfg.intermediate_size, generator=rng) if e else torch.arange(cfg.intermediate_size)
            out[f"{moe}experts.{e}.w1.weight"] = gate[order].contiguous()
            out[f"{moe}experts.{e}.w3.weight"] = up[order].contiguous()
            out[f"{moe}experts.{e}.w2.weight"] = down[:, order].contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(out, folder / "model.safetensors")
    write_hf_config(cfg, folder / "config.json")
    config = json.loads((folder / "config.json").read_text())
    config.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=EXPERTS,
        num_experts_per_tok=PER_TOKEN,
    )
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--type", default="Q4_K_M")
    parser.add_argument("--llama-quantize", default=shutil.which("llama-quantize"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    f32 = args.out / "smollm2-moe-F32.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        write_gguf_of(upcycled_checkpoint(Path(tmp) / "smollm2-moe"), f32)
    quantized = args.out / f"smollm2-moe-{args.type}.gguf"
    subprocess.run([args.llama_quantize, str(f32), str(quantized), args.type], check=True, stdout=subprocess.DEVNULL)
    print(quantized)


if __name__ == "__main__":
    main()
