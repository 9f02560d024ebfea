"""A GGUF file's header: its metadata and where each tensor lies, read in milliseconds.

The `gguf` package's `GGUFReader` builds an array view for every element of every metadata array
(a vocabulary of 128K tokens and as many merges: 2-3 s a read, on each of a first start's
readers); this reads the header once with `struct`, and keeps a string array (the vocabulary,
the merges) only as its length, which is all that the config asks of it.

The layout (ggml's docs/gguf.md): magic `GGUF`, version, tensor count, metadata count; each
metadata entry a string key, a value type and the value; each tensor's name, dimensions (fastest
first), ggml type and offset from the data section, which starts at the next multiple of
`general.alignment` (32) after the table.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

# value type -> struct format of one scalar; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class Strings:
    """A string array left unread: how many strings it holds."""

    count: int

    def __len__(self) -> int:
        return self.count


# ggml's tensor types by id (ggml.h's enum ggml_type, as the `gguf` package's GGMLQuantizationType
# names them; tests/test_gguf_loader.py checks that the two agree). Named here so that reading a
# header does not import that package, numpy and all: half a second of the launcher's CPU before
# it spawns anything on a first start.
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4",
    41: "Q1_0",
}  # fmt: skip


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # as ggml writes it, fastest-moving dimension first
    ggml_type: int
    offset: int  # from the file's start

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def kind(self) -> str:
        """The type's name (Q4_K, F32, ...); an id ggml has not named is `type <id>`, which the
        loader refuses as a type it does not know."""
        return GGML_TYPES.get(self.ggml_type, f"type {self.ggml_type}")


@dataclass(frozen=True)
class GgufHeader:
    metadata: dict[str, object]
    tensors: list[TensorEntry]
    path: Path | None = None

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def floats(self, name: str) -> list[float] | None:
        """The values of the F32 tensor `name` (a vector of the model's hyper-parameters, such as
        Phi-3's rope factors), None where the file has none."""
        entry = next((t for t in self.tensors if t.name == name), None)
        if entry is None:
            return None
        if entry.kind != "F32":
            raise ValueError(f"{self.path.name}: {name} is {entry.kind}, not F32")
        with open(self.path, "rb") as f:
            f.seek(entry.offset)
            raw = f.read(4 * entry.n_elements)
        return list(struct.unpack(f"<{entry.n_elements}f", raw))


def read_header(path: Path, strings: Container[str] = ()) -> GgufHeader:
    """`strings`: the keys whose string arrays are read in full (the tokenizer's vocabulary and
    merges, where the tokenizer is being converted); any other is kept as its length."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        return _Cursor(blob, path, strings).header()


class _Cursor:
    def __init__(self, blob, path: Path, strings: Container[str]):
        self.blob, self.path, self.pos, self.strings = blob, path, 0, strings

    def take(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.blob, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def one(self, fmt: str):
        return self.take(fmt)[0]

    def string(self) -> str:
        n = self.one("Q")
        self.pos += n
        return bytes(self.blob[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int, key: str = ""):
        if kind in _SCALARS:
            return self.one(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"{self.path.name}: unknown GGUF value type {kind}")
        item, count = self.take("IQ")
        if item == _STRING and key in self.strings:
            return [self.string() for _ in range(count)]
        if item == _STRING:  # skipped, as its length: only the vocabulary and merges are this long
            for _ in range(count):
                length = self.one("Q")  # (not `pos += one()`: that adds to the position before the read)
                self.pos += length
            return Strings(count)
        if item in _SCALARS:
            return list(self.take(f"{count}{_SCALARS[item]}"))
        return [self.value(item) for _ in range(count)]  # arrays of arrays

    def header(self) -> GgufHeader:
        if bytes(self.blob[:4]) != b"GGUF":
            raise ValueError(f"{self.path.name} is not a GGUF file (no GGUF magic)")
        self.pos = 4
        version, n_tensors, n_metadata = self.take("IQQ")
        if version < 2:
            raise ValueError(f"{self.path.name}: GGUF version {version} is not read (2 and later are)")
        metadata = {}
        for _ in range(n_metadata):
            key = self.string()
            metadata[key] = self.value(self.one("I"), key)
        table = []
        for _ in range(n_tensors):
            name = self.string()
            shape = self.take(f"{self.one('I')}Q")
            table.append((name, shape, *self.take("IQ")))
        alignment = int(metadata.get("general.alignment", 32))
        data = -(-self.pos // alignment) * alignment
        return GgufHeader(metadata, [TensorEntry(n, s, t, data + o) for n, s, t, o in table], self.path)
