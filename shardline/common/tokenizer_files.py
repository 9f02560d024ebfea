"""The tokenizer files of a model source, as a Hugging Face folder holds them: `tokenizer.json`,
`tokenizer_config.json` (special tokens, chat template) and maybe `chat_template.jinja`.

A GGUF carries its tokenizer as metadata. `transformers` converts it once into the cache folder,
in a child process (common/gguf_tokenizer.py): `transformers` maps torch, and the router process
stays free of it.
"""

from __future__ import annotations

import contextlib
import fcntl
import subprocess
import sys
import threading
from pathlib import Path

from shardline.common.model_source import ModelSource, resolve_model


def tokenizer_folder(source: ModelSource) -> Path:
    if source.kind == "hf":
        return source.path
    folder = source.cache_dir / "tokenizer"
    if (folder / "tokenizer.json").is_file():
        return folder
    source.cache_dir.mkdir(parents=True, exist_ok=True)
    with open(source.cache_dir / "tokenizer.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # one process converts; the others wait for its files
        if not (folder / "tokenizer.json").is_file():
            done = subprocess.run(
                [sys.executable, "-m", "shardline.common.gguf_tokenizer", str(source.path), str(folder)],
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise RuntimeError(f"converting the tokenizer of {source.path} failed:\n{done.stderr[-2000:]}")
    return folder


def convert_soon(model: str) -> None:
    """Starts making the model's tokenizer files in a thread, so that a GGUF's conversion (seconds,
    in a child process) runs while the caller imports the rest of itself: its own call of
    `tokenizer_folder` then waits for these files, or says why they could not be made."""

    def convert() -> None:
        with contextlib.suppress(Exception):
            tokenizer_folder(resolve_model(model))

    threading.Thread(target=convert, name="tokenizer-files", daemon=True).start()
