"""Constrained decoding, the router's half: a request's constraint compiled by llguidance into a
matcher per sequence, which says before every step which tokens may come next (a packed mask the
step plan carries to the sampling shard) and is advanced by every sampled token.

- One `Grammars` per served tokenizer. It compiles a constraint on a worker thread, within
  `timeout_s` of the compile's start, so a pathological one costs its own request a refusal
  (INVALID_ARGUMENT, with the compiler's message) and never stalls the event loop. Compiled constraints are kept by content
  (the last `CACHE_SIZE`); a sequence gets a copy of the compiled matcher and its first mask.
- A `Constrained` sequence consumes each sampled token as it arrives; the next masks of a step's
  sequences are then computed together (`next_masks`), so a dead end is found between steps and
  fails that request alone, INVALID_ARGUMENT: a matcher error, a mask that allows nothing while
  the constraint is unfinished, or a token the mask allowed that the matcher then refuses. All
  three happen where the constraint asks for text the model's tokens cannot spell (SmolLM2's
  vocabulary has no token for some control bytes, such as 0x14; llguidance then allows a token
  it refuses on the next step).
- EOS is allowed only where the constraint is complete; once it admits nothing more the
  request finishes "stop".

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

from shardline.common.token_masks import mask_bytes
from shardline.protos import generation_pb2 as pb
from shardline.router.validation import invalid

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


class Constrained:
    """One sequence's matcher and the mask of its next token."""

    def __init__(self, matcher: llg.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.mask_bytes = mask_bytes(vocab_size)  # compute_bitmask's rows have a word more
        self.error: str | None = None
        self._set_mask(matcher.compute_bitmask())

    @property
    def complete(self) -> bool:
        """The constraint admits no further token (its output is whole)."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def consume(self, token: int) -> None:
        """Advances the matcher by a sampled token; `next_masks` then computes the next mask."""
        if not self.matcher.consume_token(token):
            self.error = ("the constraint cannot be continued with this model's tokens: "
                          f"token {token} does not fit it ({self.matcher.get_error()})")

    def _set_mask(self, mask: bytes) -> None:
        self.mask = mask[:self.mask_bytes]
        if self.matcher.is_error():
            self.error = f"the constraint failed: {self.matcher.get_error()}"
        elif self.mask.count(0) == len(self.mask):
            self.error = "the constraint reached a dead end: none of this model's tokens can continue it"


def next_masks(sequences: list[Constrained]) -> None:
    """The next mask of each (unfinished, not failed) sequence. One after the other on the
    event loop's thread: llguidance's parallel executor measured slower end to end on two cores
    (its pool threads spin after each batch, taking CPU from the shards and the event loop)."""
    for c in sequences:
        c._set_mask(c.matcher.compute_bitmask())


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
        copy = lambda: Constrained(compiled.deep_copy(), self.vocab_size)  # noqa: E731 - its first mask, off the loop
        return await asyncio.get_running_loop().run_in_executor(self._workers, copy)

    async def _compile(self, grammar: str, kind: str) -> llg.LLMatcher:
        loop = asyncio.get_running_loop()
        if self._tokenizer is None:
            text, vocab_size, eos = self._tokenizer_args
            self._tokenizer = loop.run_in_executor(self._workers, lambda: llg.LLTokenizer(
                text, n_vocab=vocab_size, eos_token=eos))
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
