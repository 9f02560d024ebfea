"""A shard's weights as it serves them, kept between starts: what `GgufLoader` made of a GGUF (its
int4 and int8 records, the rest in the serving dtype), for this file, pipeline stage and TP rank,
dtype, build of the kernels (their records and the choices measured for them) and thread count.
A later start memory-maps it: nothing is read, packed or measured again, and the pages are the
page cache's, resident as decode touches them.

It is kept per version of the code that made it (`MAKERS`). The file is `torch.save`'s, read
back with `weights_only` (plain values and tensors, no code): per module of the model, what kind
it is and its values (`spec`), and its tensors under its name.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.utils.serialization
from torch import nn

from shardline.common.files import publish
from shardline.common.model_source import ModelSource
from shardline.kernels import gguf_groups, grid, native, operands, quantized, stacked
from shardline.kernels.quantized import QuantizedEmbedding, QuantizedLinear, TiedEmbedding
from shardline.kernels.stacked import StackedLinear
from shardline.shard import gguf_loader, gguf_parts
from shardline.shard.config import ModelConfig
from shardline.shard.layout import Layout
from shardline.shard.model import RMSNorm, Transformer, uninitialized
from shardline.shard.parallel import keep_stage

log = logging.getLogger(__name__)

# What makes the kept weights what they are, besides the file and the flags: a change to any of
# these sources starts a new file (as a change to the kernels' starts a new build of them).
MAKERS = [gguf_loader, gguf_parts, gguf_groups, quantized, stacked, operands, grid, sys.modules[__name__]]


def path_for(source: ModelSource, layout: Layout, dtype: torch.dtype, dense_copy: bool) -> Path:
    key = hashlib.sha256(
        f"{layout}:{dtype}:{dense_copy}:{native.build_folder().name}:{torch.get_num_threads()}".encode()
    )
    for module in MAKERS:
        key.update(Path(module.__file__).read_bytes())
    return source.cache_dir / f"served-{key.hexdigest()[:16]}.pt"


def save(model: Transformer, path: Path, background: bool = False) -> threading.Thread | None:
    """Keeps the model's weights at `path`. `background`: what to keep is gathered now (the
    model's modules may be wrapped next: shard/transforms.py), and written by a thread, which
    this returns unstarted: writing an 8B's 5 GB runs at the disk's speed (14 s on a development
    VM), and the shard serves meanwhile from the weights it made. (Started at once, its dirty
    pages slowed the KV pool's allocation and the warm-up from 5 to 18 s: the shard starts it
    after its warm-up.) A shard killed before the thread is done leaves a temporary file, which
    the next start's save removes (common/files.py)."""
    spec, tensors = {}, {}
    # A tied quantized LM head is the embedding's table too: kept once, as the LM head.
    for name, module in model.named_modules(remove_duplicate=False):
        if name.startswith("embed.") or isinstance(module, Transformer):
            continue
        if isinstance(module, StackedLinear):  # its parts follow, as the quantized layers they are
            spec[name] = {"kind": "stacked", "parts": len(module.parts)}
            tensors.update({f"{name}/bias": module.bias} if module.bias is not None else {})
        elif isinstance(module, QuantizedLinear):
            spec[name], held = module.state()
            spec[name]["kind"] = "quantized"
            tensors.update({f"{name}/{k}": t for k, t in held.items()})
        elif isinstance(module, QuantizedEmbedding):
            spec[name] = {"kind": "quantized_embedding", "rows": module.num_embeddings, "held": len(module.held)}
            tensors.update({f"{name}/{i}": t for i, t in enumerate(module.held)})
        elif isinstance(module, TiedEmbedding):
            spec[name] = {"kind": "tied_quantized"}  # the LM head's codes
        elif isinstance(module, nn.Embedding) and model.lm_head is not None and module.weight is model.lm_head.weight:
            spec[name] = {"kind": "tied_embedding"}
        elif isinstance(module, (nn.Linear, nn.Embedding, RMSNorm)):
            spec[name] = {"kind": type(module).__name__}
            tensors.update({f"{name}/{k}": t for k, t in module.named_parameters(recurse=False)})
    # No CRC of every record: computing it cost more than writing the file; the file is this
    # machine's own, and read back with weights_only
    torch.utils.serialization.config.save.compute_crc32 = False
    write = functools.partial(publish, path, lambda tmp: torch.save({"spec": spec, "tensors": tensors}, tmp))
    if not background:
        write()
        return None
    # Not a daemon: a shard that stops (shard/server.py) finishes writing at exit, within the
    # deadline its stop sets (and a daemon thread killed inside torch.save aborts the process).
    return threading.Thread(target=_logged(write), name="keep-served-weights")


def _logged(write):
    def run():
        _yield_to_decode()
        t0 = time.perf_counter()
        try:
            write()
        except Exception:  # noqa: BLE001 - the shard serves on; the next start converts again
            log.exception("could not keep the served weights")
        else:
            log.info("kept the served weights for later starts in %.1f s", time.perf_counter() - t0)

    return run


def _yield_to_decode() -> None:
    """Lowest CPU and disk priority for the calling thread (Linux: a thread's own nice value and
    I/O class): serializing the weights beside a first start's decode slowed that decode, so the
    thread writes when the cores are idle, or at the shard's stop."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        psutil.Process(threading.get_native_id()).ionice(psutil.IOPRIO_CLASS_IDLE)
    except (AttributeError, OSError, psutil.Error):  # not Linux: written at normal priority
        pass


def load(cfg: ModelConfig, layout: Layout, dtype: torch.dtype, path: Path) -> Transformer:
    kept = torch.load(path, mmap=True, weights_only=True)
    tensors = kept["tensors"]
    with torch.device("meta"), uninitialized():
        model = Transformer(cfg)
    keep_stage(model, layout)
    later = []
    by_module = {}  # module name -> its tensors by their own names
    for key, t in tensors.items():
        module, _, own_name = key.partition("/")
        by_module.setdefault(module, {})[own_name] = t
    for name, spec in kept["spec"].items():
        own = by_module.get(name, {})
        kind = spec["kind"]
        if kind == "stacked":  # its parts are set next, by their names
            module = StackedLinear([nn.Identity()] * spec["parts"], own.get("bias"))
        elif kind == "quantized":
            module = QuantizedLinear.from_state(spec, own)
        elif kind == "quantized_embedding":
            module = QuantizedEmbedding.of_held([own[str(i)] for i in range(spec["held"])], spec["rows"], dtype)
        elif kind in ("tied_quantized", "tied_embedding"):
            later.append((name, kind))
            continue
        else:
            module = model.get_submodule(name)
            for k, t in own.items():
                setattr(module, k, nn.Parameter(t, requires_grad=False))
            continue
        _set(model, name, module)
    for name, kind in later:  # what the LM head serves too
        if kind == "tied_quantized":
            _set(model, name, TiedEmbedding(model.lm_head, dtype))
        else:
            embed = nn.Embedding(1, 1)
            embed.weight = model.lm_head.weight
            _set(model, name, embed)
    with torch.device("cpu"):
        model.build_rotary()
    return model.eval().requires_grad_(False)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)
