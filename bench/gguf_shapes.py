"""Random-weight GGUFs of real model shapes, for measuring speed and memory at real sizes without
downloading a model: the shape's tensors with random f16 values and SmolLM2's tokenizer (its
vocabulary of 49,152: the embedding and LM head are that many rows), written by the `gguf`
package tensor by tensor, then quantized by llama.cpp's `llama-quantize` (Q4_K_M and the like).

    python -m bench.gguf_shapes --shape llama-3.2-1b --type Q4_K_M --out /tmp/models [--llama-quantize PATH]

Speed and memory do not depend on the values; what a model says does, so these are for nothing else.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

# hidden, intermediate, layers, heads, KV heads, tied embeddings (the published models' configs)
SHAPES = {
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, True),
    "llama-3.2-3b": (3072, 8192, 28, 24, 8, True),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, False),
}
CONTEXT = 32768


def write_f16(shape: str, path: Path, seed: int = 0) -> Path:
    """The shape's tensors, random (N(0, 0.02); norms 1), f16, with SmolLM2's tokenizer."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    from shardline.common.model_source import resolve_model

    hidden, inter, layers, heads, kv_heads, tied = SHAPES[shape]
    head_dim = hidden // heads
    smollm2 = GGUFReader(str(resolve_model(None).path))
    vocab = len(smollm2.fields["tokenizer.ggml.tokens"].data)
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(f"random {shape}")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(1)  # mostly f16
    for key, field in smollm2.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            if kind is GGUFValueType.ARRAY:
                writer.add_array(key, field.contents())
            else:
                writer.add_key_value(key, field.contents(), kind)
    tensors = [("token_embd.weight", (vocab, hidden)), ("output_norm.weight", (hidden,))]
    if not tied:
        tensors.append(("output.weight", (vocab, hidden)))
    for i in range(layers):
        p = f"blk.{i}."
        tensors += [
            (p + "attn_norm.weight", (hidden,)),
            (p + "ffn_norm.weight", (hidden,)),
            (p + "attn_q.weight", (heads * head_dim, hidden)),
            (p + "attn_k.weight", (kv_heads * head_dim, hidden)),
            (p + "attn_v.weight", (kv_heads * head_dim, hidden)),
            (p + "attn_output.weight", (hidden, heads * head_dim)),
            (p + "ffn_gate.weight", (inter, hidden)),
            (p + "ffn_up.weight", (inter, hidden)),
            (p + "ffn_down.weight", (hidden, inter)),
        ]
    for name, dims in tensors:  # norms stay f32, as llama.cpp's converter writes them
        dtype = np.float32 if len(dims) == 1 else np.float16
        n = int(np.prod(dims))
        writer.add_tensor_info(
            name,
            dims,
            np.dtype(dtype),
            n * np.dtype(dtype).itemsize,
            GGMLQuantizationType.F32 if len(dims) == 1 else GGMLQuantizationType.F16,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims in tensors:  # in the order their infos were written
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            writer.write_tensor_data((rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16))
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
