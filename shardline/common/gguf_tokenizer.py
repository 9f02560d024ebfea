"""`python -m common.gguf_tokenizer GGUF FOLDER`: writes a GGUF's tokenizer as Hugging Face files.

Runs as a child process of the router (common/tokenizer_files.py), never inside it: importing
`transformers` maps torch, which the router process does not load.
"""

from __future__ import annotations

import sys
from pathlib import Path

from shardline.common.files import publish


def convert(gguf: Path, folder: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    publish(folder, lambda tmp: tok.save_pretrained(tmp), folder=True)


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
