"""Tokenizer and chat template of the served model, plus incremental detokenization.

A GGUF carries its tokenizer and chat template; `transformers` converts them once and the result
is cached next to the converted weights, so later starts read a plain `tokenizer.json`.
"""
from __future__ import annotations

import os
import shutil

from shard.source import ModelSource

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    if source.kind == "hf":
        return AutoTokenizer.from_pretrained(source.path)
    cached = source.cache_dir / "tokenizer"
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    tok = AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
    # Saved beside and renamed into place, so a concurrent reader never sees half a folder.
    tmp = cached.with_name(f"tokenizer.{os.getpid()}.tmp")
    tok.save_pretrained(tmp)
    try:
        tmp.rename(cached)
    except OSError:  # another process got there first; its copy is as good
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


class Detokenizer:
    """Turns a growing list of token ids into text deltas, holding back an incomplete UTF-8
    sequence (decoded as U+FFFD) until the token that completes it arrives."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        after = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return after[len(before):]
        return ""


class StopMatcher:
    """Finds stop strings in the streamed text. Text that could still become the start of a stop
    string is withheld, so a client never sees part of a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to send now, whether a stop string matched)."""
        self.text += delta
        if not self.stops:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, False
        # Withheld text covers every possible stop start, so a match never begins before `sent`.
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            out, self.sent = self.text[self.sent:end], end
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        safe = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:safe], safe
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
