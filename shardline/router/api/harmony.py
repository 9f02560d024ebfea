"""gpt-oss's harmony format, read back from its output: reasoning, answer and tool calls apart.

The generation prompt ends `<|start|>assistant`; the model then writes messages, each

    [<|start|>assistant] <|channel|>CHANNEL [to=RECIPIENT] [<|constrain|>]TYPE <|message|>BODY END

(the header's parts in either order: the chat template writes `to=` first, the model often
after the channel), END being `<|end|>` (another message follows), `<|call|>` or `<|return|>`
(the turn ends: both are stop tokens, so they never reach the text). By channel:

- `analysis`: reasoning (chat completions' `reasoning_content`, Anthropic's `thinking`, the
  Responses API's `reasoning` items, as reasoning.py's <think> blocks are);
- `final`, and `commentary` without a recipient (a preamble to the user before calls): the answer;
- `commentary to=functions.NAME`: a call of NAME, its body the arguments (JSON).

An output that does not begin as a message does is the answer, as it is. The markers are
special tokens of gpt-oss's vocabulary, which a harmony model's text keeps (common/tokenizer.py).

`HarmonyReader` is a choice reader (openai/chat.py): `read` a delta, sending what may be sent now
and withholding only what may still be a marker; `state` says where the text is, as
ReasoningReader's does.
"""

from __future__ import annotations

import re
import uuid

from shardline.router.api.openai.schema import FunctionCall, ToolCall

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", START)  # what ends a body (a new message's start too)
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
_RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"(\w+)")


def _may_begin(header: str) -> bool:
    """Whether the start of an output may be a message's header."""
    header = header.lstrip()
    return any(header.startswith(m) or m.startswith(header) for m in (START, CHANNEL))


def _held_tail(text: str) -> int:
    """The length of the longest end of `text` that begins a marker (one that may be arriving)."""
    at = text.rfind("<")
    if at < 0:
        return 0
    tail = text[at:]
    return len(tail) if any(m.startswith(tail) for m in MARKERS) else 0


class HarmonyReader:
    """One choice's harmony text, split into reasoning, answer and calls as it arrives."""

    def __init__(self):
        self.calls: list[ToolCall] = []
        self.state = "start"  # start (in a header: undecided), reasoning, answer, or plain (no harmony)
        self._header = ""  # the header read so far
        self._channel, self._recipient = "", ""
        self._body = ""  # a call's arguments so far
        self._held = ""
        self._messages = 0  # messages begun

    def read(self, delta: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, answer, calls completed) that this delta, the choice's last where `final`,
        lets be sent."""
        text, self._held = self._held + delta, ""
        reasoning = answer = ""
        calls: list[ToolCall] = []
        while text:
            if self.state == "plain":
                answer, text = answer + text, ""
            elif not self._channel:  # in a header
                header, text = self._header + text, ""
                at = header.find(MESSAGE)
                if at >= 0:
                    self._begin(header[:at])
                    text = header[at + len(MESSAGE) :]
                    continue
                self._header = header
                if not self._messages and not _may_begin(self._header):  # no harmony: the answer as it is
                    self.state, text, self._header = "plain", self._header, ""
            else:  # in a body
                ends = [(i, m) for m in ENDS if (i := text.find(m)) >= 0]
                if ends:
                    at, end = min(ends)
                    body, text = text[:at], text[at + (0 if end == START else len(end)) :]
                else:
                    keep = 0 if final else _held_tail(text)
                    body, self._held, text = text[: len(text) - keep], text[len(text) - keep :], ""
                r, a = self._take(body)
                reasoning, answer = reasoning + r, answer + a
                if ends:
                    calls += self._close()
        if final and self._channel:  # cut off (or stopped) inside a message: a call's is whole now
            calls += self._close()
        return reasoning, answer, calls

    def _begin(self, header: str) -> None:
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        self._channel = channel[1] if channel else "final"
        self._recipient = recipient[1] if recipient else ""
        self.state = "reasoning" if self._channel == "analysis" and not self._recipient else "answer"
        self._header = ""
        self._messages += 1

    def _take(self, body: str) -> tuple[str, str]:
        if self._recipient:
            self._body += body
            return "", ""
        return (body, "") if self._channel == "analysis" else ("", body)

    def _close(self) -> list[ToolCall]:
        """The message ends: a call's, as a call."""
        recipient, arguments = self._recipient, self._body
        self._channel = self._recipient = self._body = ""
        self.state = "start"
        if not recipient:
            return []
        call = ToolCall(
            id=f"call_{uuid.uuid4().hex[:24]}",
            function=FunctionCall(name=recipient.removeprefix("functions."), arguments=arguments.strip()),
        )
        self.calls.append(call)
        return [call]
