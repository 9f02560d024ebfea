"""The tokenizer files of a model source, as a Hugging Face folder holds them: `tokenizer.json`,
`tokenizer_config.json` (special tokens, chat template) and maybe `chat_template.jinja`.

A GGUF carries its tokenizer as metadata. `transformers` converts it once into the cache folder,
in a child process (common/gguf_tokenizer.py): `transformers` maps torch, and the router process
stays free of it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from shardline.common.model_source import ModelSource


def tokenizer_folder(source: ModelSource) -> Path:
    if source.kind == "hf":
        return source.path
    folder = source.cache_dir / "tokenizer"
    if not (folder / "tokenizer.json").is_file():
        done = subprocess.run(
            [sys.executable, "-m", "shardline.common.gguf_tokenizer", str(source.path), str(folder)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"converting the tokenizer of {source.path} failed:\n{done.stderr[-2000:]}")
    return folder
