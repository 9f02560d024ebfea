"""An OpenAI request as the engine runs it: `n` GenerateRequests, one per choice, through the
same admission as the gRPC API's, and their outputs merged into one stream of (choice, output).

The `n` choices are admitted together (each counts toward the limits, and a refusal refuses
the request before anything is sent), and share their prompt's KV pages through the prefix
cache: the others wait in the scheduler until the first one's prompt is computed
(`Sequence.after`), then compute only the rest of the prompt's last page. They are given the
first one's token ids, so the prompt is tokenized once. Choice i of a seeded request samples
with seed + i: the same request gets the same choices, and they differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from opentelemetry import trace

from shardline.protos import generation_pb2 as pb
from shardline.router.api.openai.schema import TEMPERATURE, TOP_P, BaseRequest
from shardline.router.core.sequence import Output, Sequence
from shardline.router.requests.admission import Admission
from shardline.router.requests.validation import InvalidRequest


def _constrain(req: pb.GenerateRequest, body: BaseRequest, tool_grammar: str | None):
    """Sets the request's constraint: response_format's, structured_outputs', or the tool calls'."""
    rf, so = body.response_format, body.structured_outputs
    if rf is not None and rf.type == "json_object":
        req.json_object = True
    elif rf is not None and rf.type == "json_schema":
        req.json_schema = json.dumps(rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {})
    elif so is not None:
        if so.json_ is not None:
            req.json_schema = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
        elif so.json_object:
            req.json_object = True
        elif so.regex is not None:
            req.regex = so.regex
        elif so.grammar is not None:
            req.grammar = so.grammar
        else:
            req.choice.options.extend(so.choice)
    elif tool_grammar is not None:
        req.grammar = tool_grammar


def base_request(body: BaseRequest, tool_grammar: str | None = None) -> pb.GenerateRequest:
    """What chat and text completions ask alike: sampling, stops, constraint, vLLM's extensions.
    `tool_grammar`: what constrains the output to tool calls (tools.py)."""
    req = pb.GenerateRequest(
        stop=body.stops(), ignore_eos=body.ignore_eos, priority=body.priority, cache_salt=body.cache_salt or ""
    )
    _constrain(req, body, tool_grammar)
    s = req.sampling
    s.temperature = TEMPERATURE if body.temperature is None else body.temperature
    s.top_p = TOP_P if body.top_p is None else body.top_p
    s.top_k = max(0, body.top_k or 0)
    if body.speculative is not None:
        req.speculative = body.speculative
    return req


def per_choice(req: pb.GenerateRequest, body: BaseRequest) -> list[pb.GenerateRequest]:
    """The request of each of the `n` choices: choice i of a seeded request samples with seed + i."""
    out = []
    for i in range(body.n):
        choice = pb.GenerateRequest()
        choice.CopyFrom(req)
        if body.seed is not None:
            choice.sampling.seed = (body.seed + i) % 2**64
        if body.request_id:
            choice.request_id = body.request_id if body.n == 1 else f"{body.request_id}-{i}"
        out.append(choice)
    return out


class Choices:
    """The choices of one request. `start` admits them all (raising InvalidRequest before
    anything was sent); `outputs` yields (choice index, Output) until every choice ended;
    `release` frees whatever still runs, however the request ended (idempotent)."""

    def __init__(self, admission: Admission, reqs: list[pb.GenerateRequest], tenant: str, span=None, tracer=None):
        self.admission, self.reqs, self.tenant, self.span, self.tracer = admission, reqs, tenant, span, tracer
        self.seqs: list[Sequence] = []

    async def start(self) -> None:
        try:
            for i, req in enumerate(self.reqs):
                if i:  # the first one's tokens, computed first
                    req.prompt_token_ids.CopyFrom(pb.PromptTokens(ids=self.seqs[0].prompt_ids))
                span = self._span(i)
                try:
                    self.seqs.append(
                        await self.admission.admit(
                            req, self.tenant, span, open_ended=True, after=self.seqs[0] if i else None
                        )
                    )
                except InvalidRequest:
                    if span is not self.span:
                        span.end()
                    raise
        except InvalidRequest:
            self.release()
            raise

    def _span(self, index: int):
        """One choice: the request's own span (as a gRPC request's); of many, one child each."""
        if self.span is None or len(self.reqs) == 1:
            return self.span
        return self.tracer.start_span(f"choice {index}", context=trace.set_span_in_context(self.span))

    async def outputs(self) -> AsyncIterator[tuple[int, Output]]:
        if len(self.seqs) == 1:  # the common case, without a hop through a merging queue
            while True:
                out = await self.seqs[0].outputs.get()
                yield 0, out
                if out.finish_reason or out.failure:
                    return
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(self._pump(i, seq, queue)) for i, seq in enumerate(self.seqs)]
        try:
            for _ in range(len(self.seqs)):  # each choice's last output ends it
                while True:
                    index, out = await queue.get()
                    yield index, out
                    if out.finish_reason or out.failure:
                        break
        finally:
            for pump in pumps:
                pump.cancel()

    @staticmethod
    async def _pump(index: int, seq: Sequence, queue: asyncio.Queue) -> None:
        while True:
            out = await seq.outputs.get()
            queue.put_nowait((index, out))
            if out.finish_reason or out.failure:
                return

    def release(self) -> None:
        for seq in self.seqs:
            self.admission.release(seq)


@contextlib.asynccontextmanager
async def running(choices: Choices):
    """The choices' outputs, released when the block ends, however it ends."""
    outputs = choices.outputs()
    try:
        yield outputs
    finally:
        await outputs.aclose()
        choices.release()
