"""`python -m common.gguf_tokenizer GGUF FOLDER`: writes a GGUF's tokenizer as Hugging Face files.

Runs as a child process of the router (common/tokenizer_files.py), never inside it: `transformers`
is a second of imports the router does not otherwise need.

The conversion is transformers' own (`convert_gguf_tokenizer`: the file's vocabulary and merges
into the tokenizer class of its family, with that family's normalizer, pre-tokenizer and decoder).
Only the metadata is read here, by common/gguf_header.py, because transformers' reader imports
torch: 1.5 of the conversion's 4.5 s, on the critical path of a first start. Where the installed
transformers has no such function (an older one), its public path reads the file itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

from shardline.common.files import publish
from shardline.common.gguf_header import read_header

# special token -> the metadata key of its id (as transformers' get_gguf_tokenizer names them)
SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def convert(gguf: Path, folder: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:  # built directly, not through `AutoTokenizer`, which reads the model's config too
        tok = PreTrainedTokenizerFast(gguf_file=gguf.name, name_or_path=str(gguf.parent))
    else:
        metadata = read_header(gguf, strings=("tokenizer.ggml.tokens", "tokenizer.ggml.merges")).metadata
        described, config = (
            {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
            for renames in (GGUF_TOKENIZER_MAPPING["tokenizer"], GGUF_TOKENIZER_MAPPING["tokenizer_config"])
        )
        if described.get("tokenizer_type") == "llama":  # as transformers' get_gguf_tokenizer decides
            config.setdefault("add_bos_token", True)  # llama.cpp adds BOS to a sentencepiece vocabulary
        elif described.get("tokenizer_type") == "gemma4":
            config["add_bos_token"] = False  # its chat template writes <bos> itself
        for name, key in SPECIAL_TOKENS.items():
            token_id = metadata.get(f"tokenizer.ggml.{key}")
            config[name] = described["tokens"][token_id] if token_id is not None else None
        backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], described)
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
    publish(folder, lambda tmp: tok.save_pretrained(tmp), folder=True)


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
