"""One request's answer, streamed or whole, from its choices' outputs: what every generation
endpoint shares. `chat.py` and `completions.py` say how each writes a choice, its
log-probabilities and its chunks; another API's answer (anthropic/messages.py) frames its stream
its own way through the hooks below (`_event`, `_opening`, `_chunks`, `_closing`,
`_error_event`, `_tail`).

- Streams are server-sent events: one chunk per output of the engine (a step's text delta),
  `finish_reason` in each choice's last content chunk, with `stream_options.include_usage` a last
  chunk of usage and no choices, then `data: [DONE]`. An error after the stream started ends it
  with an error event, then `[DONE]`.
- A client that disconnects cancels its request at the next step; its pages go back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from opentelemetry.trace import Status, StatusCode
from pydantic import BaseModel

from shardline.common.tokenizer import TextCodec
from shardline.router.api.openai.choices import Choices, running
from shardline.router.api.openai.errors import ApiError
from shardline.router.api.openai.schema import (
    BaseRequest,
    CompletionTokensDetails,
    PromptTokensDetails,
    ToolCall,
    Usage,
)
from shardline.router.core.sequence import FinishReason, Output

log = logging.getLogger(__name__)
FINISH = {
    FinishReason.STOP: "stop",
    FinishReason.EOS: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
}  # vLLM's word for a request cancelled on the server


def as_json(model: BaseModel) -> str:
    """As OpenAI writes its bodies: every field, null where there is no value."""
    return model.model_dump_json()


def _sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


class Answer:
    """The choices' outputs made into an API's answer; a subclass writes them."""

    id_prefix = ""

    def __init__(self, body: BaseRequest, choices: Choices, model: str, codec: TextCodec):
        self.body, self.choices, self.model, self.codec = body, choices, model, codec
        self.id = self.id_prefix + (body.request_id or choices.seqs[0].request_id)
        self.created = int(time.time())
        n = len(choices.reqs)
        self.text = [""] * n
        self.reasoning = [""] * n  # each choice's reasoning, where the API shows it apart (reasoning.py)
        self.reasoning_tokens = [0] * n  # the tokens of the outputs that fell in it
        self._undecided = [0] * n  # tokens of a text that may still open the reasoning
        self.finish: list[str | None] = [None] * n
        self.logprobs: list[list] = [[] for _ in range(n)]  # each choice's, as the API writes them
        self._closed = False

    # -- what each API writes ----------------------------------------------------------------------
    def _read(self, index: int, text: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        """A choice's text delta as the API shows it: its reasoning, its answer, and the tool calls
        it completed."""
        return "", text, []

    def _finish_reason(self, index: int, reason: str) -> str:
        return reason

    def _logprob(self, index: int, entry):
        """A token's log-probability (core/sequence.py) as the API reports it."""
        raise NotImplementedError

    def _opening(self) -> list[BaseModel]:
        """The chunks a stream starts with."""
        return []

    def _chunk(self, index: int, delta: str, calls: list[ToolCall], logprobs: list) -> BaseModel:
        raise NotImplementedError

    def _reasoning_state(self, index: int) -> str:
        """Where a choice's text is (ReasoningReader.state: start, reasoning, answer_start or
        answer), for an API that shows reasoning apart."""
        return "answer"

    def _reasoning_chunks(self, index: int, delta: str) -> list:
        """The events of a reasoning delta (an API that shows reasoning apart writes them)."""
        return []

    def _usage_chunk(self) -> BaseModel:
        raise NotImplementedError

    def _whole(self) -> BaseModel:
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------------
    @property
    def wants_logprobs(self) -> bool:
        return self.choices.reqs[0].HasField("logprobs")

    def _take(self, index: int, out: Output) -> tuple[str, str, list[ToolCall]]:
        """Records an output; returns its reasoning and answer deltas and the tool calls it completed."""
        for entry in out.logprobs:
            self.logprobs[index].append(self._logprob(index, entry))
        before = self._reasoning_state(index)
        reasoning, text, calls = self._read(index, out.text, out.finish_reason is not None)
        self._count_reasoning(index, len(out.token_ids), before, answered=bool(text or calls))
        if out.finish_reason:
            self.finish[index] = self._finish_reason(index, FINISH[out.finish_reason])
        self.reasoning[index] += reasoning
        self.text[index] += text
        return reasoning, text, calls

    def _count_reasoning(self, index: int, tokens: int, before: str, answered: bool) -> None:
        """An output's tokens count as reasoning where they opened, continued or closed the block
        and answered nothing; those of an opening tag's first pieces once it opens."""
        after = self._reasoning_state(index)
        if not answered and "reasoning" in (before, after):
            self.reasoning_tokens[index] += self._undecided[index] + tokens
            self._undecided[index] = 0
        elif not answered and after == "start":  # held: perhaps the start of <think>
            self._undecided[index] += tokens
        else:
            self._undecided[index] = 0

    def _usage(self) -> Usage:
        seqs = self.choices.seqs
        prompt, completion = len(seqs[0].prompt_ids), sum(len(s.output_ids) for s in seqs)
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=seqs[0].cached_prompt_tokens),
            completion_tokens_details=CompletionTokensDetails(reasoning_tokens=sum(self.reasoning_tokens)),
        )

    async def _outputs(self) -> AsyncIterator[tuple[int, Output]]:
        """The choices' outputs until all ended; a failure raises ApiError."""
        async with running(self.choices) as outputs:
            async for index, out in outputs:
                if out.failure is not None:
                    raise ApiError.of(out.failure.code, out.failure.message)
                yield index, out

    def close(self) -> None:
        """Releases the choices (the engine cancels what still runs at the next step) and ends a
        request span of several choices (one choice's ends with its sequence). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.choices.release()
        span = self.choices.span
        if span is not None and len(self.choices.reqs) > 1:
            span.end()

    def _failed(self, e: ApiError) -> None:
        span = self.choices.span
        if span is not None and len(self.choices.reqs) > 1:
            span.set_status(Status(StatusCode.ERROR, e.body.error.message))

    async def whole(self, request: Request) -> str:
        # Nothing reads the request while the answer is made: a watcher hears the client leave.
        gone = asyncio.ensure_future(_disconnect(request))
        gone.add_done_callback(lambda task: task.cancelled() or self.close())
        try:
            async with contextlib.aclosing(self._outputs()) as outputs:
                async for index, out in outputs:
                    self._take(index, out)
        except ApiError as e:
            self._failed(e)
            raise
        finally:
            gone.cancel()
            self.close()
        return as_json(self._whole())

    # -- how a stream is framed (OpenAI's: `data:` events, usage last, then `[DONE]`) ----------------
    def _event(self, event) -> bytes:
        """One event of the stream as bytes (here a chunk model; another API's may be a dict)."""
        return _sse(as_json(event))

    def _chunks(self, index: int, delta: str, calls: list[ToolCall], logprobs: list) -> list:
        """The events of one output that has something to show."""
        return [self._chunk(index, delta, calls, logprobs)]

    def _closing(self) -> list:
        """The events after every choice ended."""
        options = self.body.stream_options
        return [self._usage_chunk()] if options is not None and options.include_usage else []

    def _error_event(self, error: ApiError) -> bytes:
        return self._event(error.body)

    def _tail(self) -> bytes:
        """What ends the stream, however it ended."""
        return _sse("[DONE]")

    async def stream(self) -> AsyncIterator[bytes]:
        try:
            for event in self._opening():
                yield self._event(event)
            async with contextlib.aclosing(self._outputs()) as outputs:
                async for index, out in outputs:
                    seen = len(self.logprobs[index])
                    reasoning, delta, calls = self._take(index, out)
                    for event in self._reasoning_chunks(index, reasoning) if reasoning else ():
                        yield self._event(event)
                    if not (delta or calls or out.finish_reason or out.logprobs):
                        continue  # withheld text (half a character, a possible stop string, a call, a tag)
                    for event in self._chunks(index, delta, calls, self.logprobs[index][seen:]):
                        yield self._event(event)
            for event in self._closing():
                yield self._event(event)
        except ApiError as e:
            self._failed(e)
            yield self._error_event(e)
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the stream ends with an error event
            log.error("a stream of the HTTP API failed", exc_info=e)
            yield self._error_event(ApiError(500, f"internal error ({type(e).__name__})", "server_error"))
        finally:
            self.close()
        if tail := self._tail():
            yield tail


class StreamedAnswer(StreamingResponse):
    """An answer's server-sent events, and its release however the response ends: also when the
    client left before the first event (Starlette then cancels the response before it iterates)."""

    def __init__(self, answer: Answer):
        super().__init__(answer.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.answer = answer

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.answer.close()


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone away (its body was read, so that is the next message)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
