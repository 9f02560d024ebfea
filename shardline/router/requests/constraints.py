"""Constrained decoding, the request path's half: a request's constraint compiled by llguidance
into a matcher per sequence (core/constrained.py), which the engine then advances.

- One `Grammars` per served tokenizer. It compiles a constraint on a worker thread, within
  `timeout_s` of the compile's start, so a pathological one costs its own request a refusal
  (INVALID_ARGUMENT, with the compiler's message) and never stalls the event loop. Compiled
  constraints are kept by content (the last `CACHE_SIZE`); a sequence gets a copy of the
  compiled matcher and its first mask.

Between JSON tokens the output may hold `JSON_WHITESPACE`, llama.cpp's choice: nothing, a space,
or a line break and an indent of up to 20 (pretty-printed JSON fits). Unbounded whitespace, which
JSON allows, lets a sampled answer run to max_tokens without ever closing.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import llguidance as llg

from shardline.protos import generation_pb2 as pb
from shardline.router.core.constrained import Constrained
from shardline.router.requests.validation import invalid

CACHE_SIZE = 256
MAX_CHOICES = 1024
JSON_WHITESPACE = r"(\x20|\n[\x20\t]{0,20})?"
_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}


def grammar_of(req: pb.GenerateRequest) -> str | None:
    """The llguidance grammar of the request's constraint, or None; raises InvalidRequest for one
    that is malformed before it is compiled."""
    kind = req.WhichOneof("constraint")
    try:
        if kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(req.json_schema, defaults=_JSON_OPTIONS)
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(req.regex)
        if kind == "grammar":
            return llg.grammar_from("grammar", req.grammar)
        if kind == "choice":
            options = list(req.choice.options)
            if not 1 <= len(options) <= MAX_CHOICES or not all(options):
                raise invalid(f"choice: 1 to {MAX_CHOICES} options, none of them empty")
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
    except ValueError as e:
        raise invalid(f"{kind}: {e}") from None
    return None


class Grammars:
    """Compiles constraints for one tokenizer (tokenizer.json's text), vocabulary size (the
    model's, so masks cover every logit) and EOS tokens."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int], timeout_s: float):
        self.timeout_s, self.vocab_size = timeout_s, vocab_size
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="constraints")
        self._tokenizer_args = (tokenizer_json, vocab_size, sorted(eos_ids))
        self._tokenizer: asyncio.Future | None = None  # built on first use (a third of a second)
        self._compiled: OrderedDict[str, asyncio.Future] = OrderedDict()

    async def constrained(self, req: pb.GenerateRequest) -> Constrained | None:
        """The request's constrained state, or None when it has no constraint; raises InvalidRequest."""
        grammar = grammar_of(req)
        if grammar is None:
            return None
        compiled = await self._compile(grammar, req.WhichOneof("constraint"))
        copy = lambda: Constrained(compiled.deep_copy())  # noqa: E731 - its first mask, off the loop
        return await asyncio.get_running_loop().run_in_executor(self._workers, copy)

    async def _compile(self, grammar: str, kind: str) -> llg.LLMatcher:
        loop = asyncio.get_running_loop()
        if self._tokenizer is None:
            text, vocab_size, eos = self._tokenizer_args
            self._tokenizer = loop.run_in_executor(
                self._workers, lambda: llg.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
            )
        tokenizer = await asyncio.shield(self._tokenizer)  # its build is not the constraint's time
        future = self._compiled.get(grammar)
        if future is None:
            future = asyncio.ensure_future(self._build(tokenizer, grammar))
            self._compiled[grammar] = future
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        try:
            matcher = await asyncio.shield(future)
        except asyncio.TimeoutError:
            if self._compiled.get(grammar) is future:
                del self._compiled[grammar]  # a later try may find the machine less busy
            raise invalid(f"{kind}: compiling the constraint took over {self.timeout_s:g} s") from None
        if matcher.is_error():
            raise invalid(f"{kind}: {matcher.get_error()}")
        return matcher

    async def _build(self, tokenizer: llg.LLTokenizer, grammar: str) -> llg.LLMatcher:
        """Compiles on a worker within `timeout_s` of the compile's start: the time it waits for a
        worker (behind another request's slow constraint, say) is not its own."""
        loop = asyncio.get_running_loop()
        started = loop.create_future()

        def build() -> llg.LLMatcher:
            loop.call_soon_threadsafe(started.set_result, None)
            return llg.LLMatcher(tokenizer, grammar, log_level=0)

        matcher = loop.run_in_executor(self._workers, build)
        await started
        return await asyncio.wait_for(matcher, self.timeout_s)
