"""The tokenizer files of a model source, as a Hugging Face folder holds them: `tokenizer.json`,
`tokenizer_config.json` (special tokens, chat template) and maybe `chat_template.jinja`.

A GGUF carries its tokenizer as metadata. `transformers` converts it once into the cache folder,
in a child process: `transformers` maps torch, and the router process stays free of it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from common.model_source import ModelSource


def tokenizer_folder(source: ModelSource) -> Path:
    if source.kind == "hf":
        return source.path
    folder = source.cache_dir / "tokenizer"
    if not (folder / "tokenizer.json").is_file():
        done = subprocess.run([sys.executable, "-m", "common.tokenizer_files", str(source.path), str(folder)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"converting the tokenizer of {source.path} failed:\n{done.stderr[-2000:]}")
    return folder


def _convert(gguf: Path, folder: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Saved beside and renamed into place, so a concurrent reader never sees half a folder.
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    tok.save_pretrained(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another process got there first; its copy is as good
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    _convert(Path(sys.argv[1]), Path(sys.argv[2]))
