"""Random-weight GGUFs of real model shapes, for measuring speed and memory at real sizes without
downloading a model: the shape's tensors with random f16 values and SmolLM2's tokenizer (its
vocabulary of 49,152: the embedding and LM head are that many rows), written by the `gguf`
package tensor by tensor, then quantized by llama.cpp's `llama-quantize` (Q4_K_M and the like).

    python -m bench.gguf_shapes --shape llama-3.2-1b --type Q4_K_M --out /tmp/models [--llama-quantize PATH]

Speed and memory do not depend on the values; what a model says does, so these are for nothing else.
(One exception: a mixture's random router spreads tokens over its experts more evenly than a
trained one may, which matters to how many experts a batch of streams reads a step.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    """A published model's dimensions (its config). Dense shapes are `llama` GGUFs; a mixture of
    experts is `qwen3moe` (q/k norms, every layer sparse: `experts` MLPs of `expert_intermediate`,
    `experts_used` a token, weights renormalized over the picked ones, as qwen3moe always does);
    Gemma 3 is `gemma3` (q/k norms, norms after each sublayer too, local layers of `window`
    tokens at base `rope_base_swa`, five to each global one, whose frequencies `rope_scale`
    divides), as llama.cpp's converter writes it."""

    hidden: int
    intermediate: int  # the dense MLP's (written for a mixture too, where no layer uses it)
    layers: int
    heads: int
    kv_heads: int
    tied: bool  # embeddings shared with the LM head
    arch: str = "llama"
    rope_base: float = 500000.0
    rms_eps: float = 1e-5
    context: int = 32768
    experts: int = 0
    experts_used: int = 0
    expert_intermediate: int = 0
    head_size: int = 0  # 0: hidden / heads
    window: int = 0
    rope_base_swa: float = 10000.0
    rope_scale: float = 1.0

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads


SHAPES = {
    "llama-3.2-1b": Shape(2048, 8192, 16, 32, 8, tied=True),
    "llama-3.2-3b": Shape(3072, 8192, 28, 24, 8, tied=True),
    "llama-3.1-8b": Shape(4096, 14336, 32, 32, 8, tied=False),
    # OLMoE-1B-7B's dimensions as a Qwen3-MoE GGUF: 6.9B parameters, 1.3B of them a token's
    "olmoe-1b-7b": Shape(
        2048,
        1024,
        16,
        16,
        16,
        tied=False,
        arch="qwen3moe",
        rope_base=10000.0,
        context=4096,
        experts=64,
        experts_used=8,
        expert_intermediate=1024,
    ),
    # Gemma 3's (text): the 270M to check a shape by, the 4B to measure
    "gemma-3-270m": Shape(
        640, 2048, 18, 4, 1, tied=True, arch="gemma3", rope_base=1e6, rms_eps=1e-6, head_size=256, window=512
    ),
    "gemma-3-4b": Shape(
        2560,
        10240,
        34,
        8,
        4,
        tied=True,
        arch="gemma3",
        rope_base=1e6,
        rms_eps=1e-6,
        head_size=256,
        window=1024,
        rope_scale=8.0,
    ),
}

# how each kind of tensor is written: norms and the router f32 (as llama.cpp's converter writes
# them, and llama-quantize leaves the router so), the rest f16
F32 = ("_norm.weight", "ffn_gate_inp.weight")


def tensor_shapes(s: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor, in the order they are written: GGUF's dimensions are
    these reversed (`ffn_gate_inp` is [n_embd, n_expert] in GGUF, (n_expert, n_embd) here)."""
    hidden, hd = s.hidden, s.head_dim
    tensors = [("token_embd.weight", (vocab, hidden)), ("output_norm.weight", (hidden,))]
    if not s.tied:
        tensors.append(("output.weight", (vocab, hidden)))
    for i in range(s.layers):
        p = f"blk.{i}."
        tensors += [
            (p + "attn_norm.weight", (hidden,)),
            (p + "ffn_norm.weight", (hidden,)),
            (p + "attn_q.weight", (s.heads * hd, hidden)),
            (p + "attn_k.weight", (s.kv_heads * hd, hidden)),
            (p + "attn_v.weight", (s.kv_heads * hd, hidden)),
            (p + "attn_output.weight", (hidden, s.heads * hd)),
        ]
        if s.arch in ("qwen3moe", "gemma3"):
            tensors += [(p + "attn_q_norm.weight", (hd,)), (p + "attn_k_norm.weight", (hd,))]
        if s.arch == "gemma3":
            tensors += [(p + "post_attention_norm.weight", (hidden,)), (p + "post_ffw_norm.weight", (hidden,))]
        if s.experts:
            n, ff = s.experts, s.expert_intermediate
            tensors += [
                (p + "ffn_gate_inp.weight", (n, hidden)),
                (p + "ffn_gate_exps.weight", (n, ff, hidden)),
                (p + "ffn_up_exps.weight", (n, ff, hidden)),
                (p + "ffn_down_exps.weight", (n, hidden, ff)),
            ]
        else:
            tensors += [
                (p + "ffn_gate.weight", (s.intermediate, hidden)),
                (p + "ffn_up.weight", (s.intermediate, hidden)),
                (p + "ffn_down.weight", (hidden, s.intermediate)),
            ]
    return tensors


def write_f16(shape: str, path: Path, seed: int = 0) -> Path:
    """The shape's tensors, random (N(0, 0.02); norms 1), f16 (norms and routers f32), with
    SmolLM2's tokenizer; each tensor is made, written and dropped in turn."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from harness.gguf_of import add_smollm2_tokenizer

    s = SHAPES[shape]
    writer = GGUFWriter(str(path), s.arch)
    writer.add_name(f"random {shape}")
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.intermediate)
    writer.add_block_count(s.layers)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_rope_freq_base(s.rope_base)
    writer.add_layer_norm_rms_eps(s.rms_eps)
    writer.add_rope_dimension_count(s.head_dim)
    if s.experts or s.head_size:
        writer.add_key_length(s.head_dim)
        writer.add_value_length(s.head_dim)
    if s.window:  # Gemma 3's keys, as its converter writes them
        from gguf import RopeScalingType

        writer.add_sliding_window(s.window)
        writer.add_rope_freq_base_swa(s.rope_base_swa)
        if s.rope_scale != 1:
            writer.add_rope_scaling_type(RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(s.rope_scale)
    if s.experts:
        writer.add_expert_count(s.experts)
        writer.add_expert_used_count(s.experts_used)
        writer.add_expert_feed_forward_length(s.expert_intermediate)
    writer.add_file_type(1)  # mostly f16
    vocab = add_smollm2_tokenizer(writer)
    tensors = tensor_shapes(s, vocab)
    for name, dims in tensors:
        f32 = name.endswith(F32)
        dtype = np.dtype(np.float32 if f32 else np.float16)
        raw = GGMLQuantizationType.F32 if f32 else GGMLQuantizationType.F16
        writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize, raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in tensors:  # in the order their infos were written, one at a time
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
            continue
        w = rng.standard_normal(dims, dtype=np.float32)
        w *= 0.02
        writer.write_tensor_data(w if name.endswith(F32) else w.astype(np.float16))
        del w
    writer.close()
    return path


def quantize(f16: Path, out: Path, kind: str, llama_quantize: str) -> Path:
    subprocess.run(
        [llama_quantize, str(f16), str(out), kind, str(os.cpu_count())], check=True, stdout=subprocess.DEVNULL
    )
    return out


def make(shape: str, kind: str, folder: Path, llama_quantize: str | None) -> Path:
    """`folder`/<shape>-<kind>.gguf, made unless it is there; the f16 source is deleted after.
    Files are written under a `.part` name and renamed when whole, so that a run stopped midway
    leaves nothing that a later one would take for the model."""
    out = folder / f"{shape}-{kind}.gguf"
    if out.is_file():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    f16 = write_f16(shape, folder / f"{shape}-F16.gguf.part")
    if kind == "F16":
        return f16.rename(out)
    part = out.with_name(out.name + ".part")
    try:
        quantize(f16, part, kind, llama_quantize or shutil.which("llama-quantize"))
        return part.rename(out)
    finally:
        f16.unlink()
        part.unlink(missing_ok=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), required=True)
    p.add_argument("--type", default="Q4_K_M")
    p.add_argument("--out", type=Path, default=Path("/tmp/shardline-shapes"))
    p.add_argument("--llama-quantize", default=os.environ.get("LLAMA_QUANTIZE"))
    args = p.parse_args()
    print(make(args.shape, args.type, args.out, args.llama_quantize))


if __name__ == "__main__":
    main()
