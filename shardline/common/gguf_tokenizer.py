"""`python -m common.gguf_tokenizer GGUF FOLDER`: writes a GGUF's tokenizer as Hugging Face files.

Runs as a child process of the router (common/tokenizer_files.py), never inside it: importing
`transformers` maps torch, which the router process does not load.
"""

from __future__ import annotations

import sys
from pathlib import Path

from shardline.common.files import publish


def convert(gguf: Path, folder: Path) -> None:
    """The fast tokenizer that transformers' GGUF converter builds from the file's metadata, with
    its special tokens and chat template. Built directly, not through `AutoTokenizer`: that reads
    the model's config from the GGUF first, with `gguf`'s reader (seconds on a first start's
    path), to pick a class whose files come out the same."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(gguf_file=gguf.name, name_or_path=str(gguf.parent))
    publish(folder, lambda tmp: tok.save_pretrained(tmp), folder=True)


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
