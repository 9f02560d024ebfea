"""`/v1/chat/completions`: messages in (with tools), a message or its deltas out, reasoning read
apart from the answer (`reasoning_content`: reasoning.py), tool calls read back from the answer
(tools.py), log-probabilities as `logprobs.content[]`."""

from __future__ import annotations

import json

from shardline.common.tokenizer import TextCodec
from shardline.protos import generation_pb2 as pb
from shardline.router.api.harmony import HarmonyReader
from shardline.router.api.openai import tools
from shardline.router.api.openai.answer import Answer
from shardline.router.api.openai.choices import Choices, base_request, per_choice
from shardline.router.api.openai.schema import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatMessage,
    Delta,
    Message,
    TokenLogprob,
    Tool,
    ToolCall,
    TopLogprob,
)
from shardline.router.api.openai.tools import ToolCallReader, ToolFormat, call_deltas
from shardline.router.api.reasoning import ReasoningFormat, ReasoningReader


def chat_requests(body: ChatCompletionRequest, tool_format: ToolFormat) -> list[pb.GenerateRequest]:
    """The choices' requests. Without max_tokens a chat is open-ended (max_new_tokens 0): up to
    the context. `tool_format`: how the model writes its calls."""
    req = base_request(body, tools.grammar(body, tool_format))
    req.max_new_tokens = body.max_completion_tokens or body.max_tokens or 0
    if body.logprobs:
        req.logprobs = body.top_logprobs or 0
    req.messages.CopyFrom(chat_messages(body.messages, body.tools, tool_format.id_chars))
    if body.chat_template_kwargs:
        req.messages.template_kwargs_json = json.dumps(body.chat_template_kwargs)
    return per_choice(req, body)


def chat_messages(messages: list[Message], tool_list: list[Tool] | None, id_chars: int = 0) -> pb.ChatMessages:
    """The conversation as the chat template reads it (common/prompts.py), call ids cut to their
    last `id_chars` where the template takes ids of that length (Mistral's 9)."""

    def cut(call_id: str) -> str:
        return call_id[-id_chars:] if id_chars else call_id

    out = pb.ChatMessages()
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        calls = [c.model_dump() | {"id": cut(c.id)} for c in m.tool_calls or []]
        out.messages.append(
            pb.ChatMessage(
                role=role,
                content=m.text(),
                tool_calls_json=json.dumps(calls) if calls else "",
                tool_call_id=cut(m.tool_call_id or ""),
                name=m.name or "",
            )
        )
    if tool_list:
        out.tools_json = json.dumps([t.model_dump(exclude_none=True) for t in tool_list])
    return out


class SplitReader:
    """A choice's text read apart: its reasoning first (reasoning.py), then the calls in what is
    left (tools.py). A choice reader, as harmony.py's HarmonyReader is."""

    def __init__(self, kind: str | None, tool_format: ToolFormat, reasoning: ReasoningFormat | None):
        self.reasoner, self.caller = ReasoningReader(reasoning), ToolCallReader(kind, tool_format)

    @property
    def state(self) -> str:
        return self.reasoner.state

    @property
    def calls(self) -> list[ToolCall]:
        return self.caller.calls

    def read(self, text: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        reasoning, text = self.reasoner.feed(text)
        if final:
            more_reasoning, rest = self.reasoner.end()
            reasoning, text = reasoning + more_reasoning, text + rest
        text, calls = self.caller.feed(text)
        if final:
            rest, more = self.caller.end()
            text, calls = text + rest, calls + more
        return reasoning, text, calls


class ChatAnswer(Answer):
    id_prefix = "chatcmpl-"

    def __init__(
        self,
        body: ChatCompletionRequest,
        choices: Choices,
        model: str,
        codec: TextCodec,
        tool_format: ToolFormat,
        reasoning: ReasoningFormat | None = None,
    ):
        super().__init__(body, choices, model, codec)
        kind = tools.mode(body, tool_format)
        harmony = reasoning is not None and reasoning.harmony
        self.readers = [HarmonyReader() if harmony else SplitReader(kind, tool_format, reasoning) for _ in self.text]

    def _read(self, index: int, text: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        return self.readers[index].read(text, final)

    def _reasoning_state(self, index: int) -> str:
        return self.readers[index].state

    def _finish_reason(self, index: int, reason: str) -> str:
        return "tool_calls" if self.readers[index].calls and reason == "stop" else reason

    def _logprob(self, index: int, entry) -> TokenLogprob:
        codec = self.codec
        return TokenLogprob(
            token=codec.token_text(entry.token_id),
            logprob=entry.logprob,
            bytes=list(codec.token_bytes(entry.token_id)),
            top_logprobs=[
                TopLogprob(token=codec.token_text(t), logprob=v, bytes=list(codec.token_bytes(t)))
                for t, v in zip(entry.top_ids, entry.top_logprobs)
            ],
        )

    def _choice_logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs | None:
        return ChatLogprobs(content=entries) if self.wants_logprobs else None

    def _message(self, index: int) -> ChatMessage:
        calls = self.readers[index].calls
        content = self.text[index] or None if calls else self.text[index]
        return ChatMessage(content=content, reasoning_content=self.reasoning[index] or None, tool_calls=calls or None)

    def _whole(self) -> ChatCompletion:
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            usage=self._usage(),
            choices=[
                ChatChoice(
                    index=i,
                    message=self._message(i),
                    finish_reason=self.finish[i],
                    logprobs=self._choice_logprobs(self.logprobs[i]),
                )
                for i in range(len(self.text))
            ],
        )

    def _opening(self) -> list[ChatCompletionChunk]:
        # OpenAI opens every choice with the assistant's role.
        return [
            self._chunk_of(
                [ChatChunkChoice(index=i, delta=Delta(role="assistant", content="")) for i in range(len(self.text))]
            )
        ]

    def _chunk(self, index: int, delta: str, calls: list[ToolCall], logprobs: list) -> ChatCompletionChunk:
        tool_calls = call_deltas(self.readers[index].calls, calls) if calls else None
        content = delta if delta or not tool_calls else None
        return self._chunk_of(
            [
                ChatChunkChoice(
                    index=index,
                    delta=Delta(content=content, tool_calls=tool_calls),
                    finish_reason=self.finish[index],
                    logprobs=self._choice_logprobs(logprobs),
                )
            ]
        )

    def _reasoning_chunks(self, index: int, delta: str) -> list[ChatCompletionChunk]:
        return [self._chunk_of([ChatChunkChoice(index=index, delta=Delta(reasoning_content=delta))])]

    def _usage_chunk(self) -> ChatCompletionChunk:
        return self._chunk_of([], self._usage())

    def _chunk_of(self, choices: list[ChatChunkChoice], usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
