"""Reasoning text, read apart from the answer: what a model writes between `<think>` and
`</think>` before it answers (Qwen3, SmolLM3, DeepSeek-R1's distillations), which each API shows
on its own (chat completions' `reasoning_content`, as vLLM and llama-server name it; Anthropic's
`thinking` blocks; the Responses API's `reasoning` items).

The rule, for a model whose chat template mentions `<think>`: an output that begins with
`<think>` (leading whitespace aside) reasons until `</think>`; where the template's generation
prompt itself ends with an open `<think>` (the thinking variants of Qwen3-2507, DeepSeek-R1),
the output begins inside the reasoning. Everything after `</think>` is the answer, its leading
newlines dropped. An output that never closes its reasoning is all reasoning. A template without
`<think>` leaves every output as the answer.

`ReasoningReader` splits a choice's text as it streams: `feed` returns what may be sent now of
each part, withholding only what may still turn out to be a tag; `end` what is left. Usage
counts the tokens of the outputs that fell in the reasoning, its tags among them (chat's
`completion_tokens_details.reasoning_tokens`, the Responses API's `output_tokens_details`).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardline.common.tokenizer import TemplateError, TextCodec

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """A model that reasons in <think> blocks (`opened`: its generation prompt opens one), or in
    harmony's analysis channel (gpt-oss's: harmony.py, which reads its calls too)."""

    opened: bool = False
    harmony: bool = False


def reasoning_format(codec: TextCodec, parser: str = "auto") -> ReasoningFormat | None:
    """How the model's chat template has it reason, or None where it does not; `parser`
    (`--reasoning-parser`) may say <think> blocks ("think") or no reasoning ("none") instead."""
    if parser == "none":
        return None
    if codec.harmony and parser == "auto":
        return ReasoningFormat(harmony=True)
    if parser == "auto" and (not codec.template_source or OPEN not in codec.template_source):
        return None
    try:
        prompt = codec.render_chat([{"role": "user", "content": "?"}])
    except TemplateError:
        prompt = ""
    return ReasoningFormat(opened=prompt.rstrip().endswith(OPEN))


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (a tag that may be arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningReader:
    """One choice's text, split into reasoning and answer as it arrives."""

    def __init__(self, fmt: ReasoningFormat | None):
        # "start": may still open reasoning; "reasoning"; "answer_start": drops leading newlines
        self.state = "answer" if fmt is None else "reasoning" if fmt.opened else "start"
        self.reasoning = ""  # all of it so far, for a whole answer
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, answer) that this delta lets be sent."""
        text, self._held = self._held + delta, ""
        reasoning = answer = ""
        if self.state == "start":
            stripped = text.lstrip()
            if stripped.startswith(OPEN):
                self.state, text = "reasoning", stripped[len(OPEN) :]
            elif OPEN.startswith(stripped):
                self._held = text  # "", "<", "<th", ...: may still open it
                return "", ""
            else:
                self.state = "answer"
        if self.state == "reasoning":
            end = text.find(CLOSE)
            if end < 0:
                keep = _partial_tail(text, CLOSE)
                reasoning, self._held = text[: len(text) - keep], text[len(text) - keep :]
                self.reasoning += reasoning
                return reasoning, ""
            reasoning, text = text[:end], text[end + len(CLOSE) :]
            self.reasoning += reasoning
            self.state = "answer_start"
        if self.state == "answer_start":
            text = text.lstrip("\n")
            if not text:
                return reasoning, ""
            self.state = "answer"
        answer = text
        return reasoning, answer

    def end(self) -> tuple[str, str]:
        """At the choice's end: what was withheld, as the part it was in."""
        held, self._held = self._held, ""
        if self.state == "reasoning":
            self.reasoning += held
            return held, ""
        return "", held if self.state != "answer_start" else held.lstrip("\n")
