"""Tool calls in the OpenAI API: the grammar that makes a call valid by construction, and the
calls read back out of a choice's text, whole or as the text streams.

How a model writes a call is what its chat template declares (`tool_format`):
- Hermes / Qwen (a template that mentions `<tool_call>`): each call as
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one per line when it makes
  several;
- Llama 3.1 to 3.3 (a template that asks for `{"name": function name, "parameters": ...}`): one
  call as that JSON object alone, its arguments under "parameters";
- gpt-oss (a harmony template): each call a `commentary` message to `functions.NAME`, read by
  router/api/harmony.py, and not constrained (its markers are special tokens);
- Mistral: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (Mistral Nemo's template),
  or `[TOOL_CALLS]NAME[ARGS]{...}` per call (Mistral Small 3.2's, Devstral's, Ministral 3's);
  read, not constrained ([TOOL_CALLS] and [ARGS] are special tokens), and a call's id rendered
  back as its last 9 characters (the templates take ids of 9, as vLLM renders them);
- any other model: one call as `{"name": ..., "arguments": {...}}` alone.

- `tool_choice` "required" or a named function: the output is constrained to calls of the
  tools (of that one tool), with arguments valid for its `parameters` schema.
- "auto" (the default when tools are given): with a declared format, the output is either text
  that does not begin as a call does (`<tool_call>`; for Llama 3, `{`) or calls, so a call the
  model starts is valid; without one the output is text, unconstrained.
- "none": the tools are rendered into the prompt, the output is text.

A choice whose text holds calls answers `message.tool_calls` (content null) and finish reason
`tool_calls`. Streamed, a call is sent as one tool-call delta (id, name and the whole arguments)
once its text is complete.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from shardline.common.tokenizer import speaks_harmony
from shardline.router.api.openai.schema import (
    ChatCompletionRequest,
    FunctionCall,
    FunctionDelta,
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
)
from shardline.router.requests.constraints import JSON_WHITESPACE

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes its calls."""

    blocks: bool  # each call in a <tool_call> block (else one JSON object alone)
    arguments: str = "arguments"  # the key of a call's arguments
    start: str = ""  # what a call's text begins with, where the template declares the format ("": none)
    harmony: bool = False  # gpt-oss's: calls are harmony messages (router/api/harmony.py reads them)
    mistral: str = ""  # Mistral's: "list" ([TOOL_CALLS] then a JSON list) or "args" ([TOOL_CALLS]NAME[ARGS]{...})
    id_chars: int = 0  # the call ids' length the template takes (0: any): their last characters

    @property
    def constrained(self) -> bool:
        """Whether a grammar here can write the calls (harmony's and Mistral's markers are
        special tokens, which it does not write yet)."""
        return not (self.harmony or self.mistral)


HERMES = ToolFormat(blocks=True, start=OPEN)
LLAMA3 = ToolFormat(blocks=False, arguments="parameters", start="{")
PLAIN = ToolFormat(blocks=False)
HARMONY = ToolFormat(blocks=False, harmony=True)
MISTRAL_LIST = ToolFormat(blocks=False, start="[TOOL_CALLS]", mistral="list", id_chars=9)
MISTRAL_ARGS = ToolFormat(blocks=False, start="[TOOL_CALLS]", mistral="args", id_chars=9)


def tool_format(template_source: str | None) -> ToolFormat:
    """The format a chat template declares for its model's calls."""
    source = template_source or ""
    if speaks_harmony(source):
        return HARMONY
    if "<tool_call>" in source:
        return HERMES
    if '"parameters": dictionary of argument name' in source:  # Llama 3.1, 3.2 and 3.3's words
        return LLAMA3
    if "[TOOL_CALLS][" in source:
        return MISTRAL_LIST
    if "[ARGS]" in source and "[TOOL_CALLS]" in source:
        return MISTRAL_ARGS
    return PLAIN


def _call_schema(body: ChatCompletionRequest, fmt: ToolFormat) -> dict:
    tools = body.tools or []
    if isinstance(body.tool_choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == body.tool_choice.function.name]
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                fmt.arguments: t.function.parameters or {"type": "object"},
            },
            "required": ["name", fmt.arguments],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return {"anyOf": calls, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}


def mode(body: ChatCompletionRequest, fmt: ToolFormat) -> str | None:
    """ "calls" (the output is calls), "auto" (text or calls) or None (text) for this request."""
    if not body.tools or body.tool_choice == "none" or fmt.harmony:
        return None  # (a harmony call's markers are special tokens, which no grammar here writes yet)
    if body.calls_forced():
        return "calls"
    if not fmt.constrained:  # read: whatever the model writes, text or calls
        return "auto"
    constrained = body.structured_outputs is not None or (
        body.response_format is not None and body.response_format.type != "text"
    )
    return "auto" if fmt.start and not constrained else None


def grammar(body: ChatCompletionRequest, fmt: ToolFormat) -> str | None:
    """The Lark grammar (llguidance's) that constrains this request's output, or None."""
    kind = mode(body, fmt)
    if kind is None or not fmt.constrained:
        return None
    call = "%json " + json.dumps(_call_schema(body, fmt))
    if not fmt.blocks:
        if kind == "auto":  # text that does not begin as a call does, or the call
            return f"start: TEXT | call\nTEXT: /(?s:.*)/ & ~/{re.escape(fmt.start)}(?s:.*)/\ncall: {call}\n"
        return f"start: {call}\n"
    many = ' ("\\n" call)*' if body.parallel_tool_calls and not isinstance(body.tool_choice, NamedToolChoice) else ""
    rules = f"calls: call{many}\ncall: {json.dumps(OPEN)} {call} {json.dumps(CLOSE)}\n"
    if kind == "auto":
        return "start: TEXT | calls\nTEXT: /(?s:.*)/ & ~/<tool_call>(?s:.*)/\n" + rules
    return "start: calls\n" + rules


def _made(name: str, arguments) -> ToolCall:
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        function=FunctionCall(
            name=name,
            arguments=arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
        ),
    )


def _call(text: str, key: str) -> ToolCall | None:
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(data, dict) and isinstance(data.get("name"), str) and key in data):
        return None
    return _made(data["name"], data[key])


def _mistral_calls(text: str, fmt: ToolFormat) -> list[ToolCall]:
    """A Mistral answer's calls (none where it does not parse as calls)."""
    if fmt.mistral == "list":
        calls = [_call(json.dumps(c), "arguments") for c in _json_list(text.strip().removeprefix(fmt.start))]
        return calls if calls and all(calls) else []
    calls = []
    for part in text.strip().split(fmt.start)[1:]:  # NAME[CALL_ID]ID[ARGS]{...}, the id where written
        name, args = part.split("[ARGS]", 1) if "[ARGS]" in part else ("", "")
        name = name.split("[CALL_ID]")[0].strip()
        try:
            json.loads(args)
        except ValueError:
            return []
        if not name:
            return []
        calls.append(_made(name, args.strip()))
    return calls


def _json_list(text: str) -> list:
    try:
        data = json.loads(text)
    except ValueError:
        return []
    return data if isinstance(data, list) else []


class ToolCallReader:
    """One choice's text, split into content and calls as it arrives. `feed` returns the content
    that may be sent now and the calls completed by this delta; `end` what is left."""

    def __init__(self, kind: str | None, fmt: ToolFormat):
        self.kind, self.fmt = kind, fmt
        self.calls: list[ToolCall] = []
        self._text = ""  # what is not yet sent as content or read as calls
        self._calling = kind == "calls"

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        if self.kind is None:
            return delta, []
        self._text += delta
        if not self._calling:
            start = self.fmt.start
            if self._text.startswith(start):
                self._calling = True
            elif start.startswith(self._text):
                return "", []  # may still become a call: withheld
            else:  # text: from here on passed through
                self.kind, text, self._text = None, self._text, ""
                return text, []
        if not self.fmt.blocks:
            return "", []
        found = []
        while (m := _BLOCK.search(self._text)) is not None:
            call = _call(m[1], self.fmt.arguments)
            if call is not None:
                found.append(call)
            self._text = self._text[m.end() :]
        self.calls += found
        return "", found

    def end(self) -> tuple[str, list[ToolCall]]:
        """At the choice's end: text that did not make a call becomes content."""
        text, self._text = self._text, ""
        if self.kind is None:
            return text, []
        if self.fmt.mistral:
            calls = _mistral_calls(text, self.fmt)
            self.calls += calls
            return ("", calls) if calls else (text, [])
        call = None if self.fmt.blocks else _call(text, self.fmt.arguments)
        if call is not None:
            self.calls.append(call)
            return "", [call]
        return "" if not text.strip() and self.calls else text, []


def call_deltas(every: list[ToolCall], new: list[ToolCall]) -> list[ToolCallDelta]:
    """The stream's deltas of a choice's `new` calls, the last of `every` call it made."""
    first = len(every) - len(new)
    return [
        ToolCallDelta(
            index=first + i,
            id=c.id,
            type="function",
            function=FunctionDelta(name=c.function.name, arguments=c.function.arguments),
        )
        for i, c in enumerate(new)
    ]
