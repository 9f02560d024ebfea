"""`/v1/completions`: a prompt (text or token ids) in, text out, log-probabilities in the legacy
format (tokens, token_logprobs, top_logprobs, text_offset)."""

from __future__ import annotations

from shardline.common.tokenizer import TextCodec
from shardline.protos import generation_pb2 as pb
from shardline.router.api.openai.answer import Answer
from shardline.router.api.openai.choices import Choices, base_request, per_choice
from shardline.router.api.openai.schema import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ToolCall,
)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for text completions


def completion_requests(body: CompletionRequest) -> list[pb.GenerateRequest]:
    req = base_request(body)
    req.max_new_tokens = body.max_tokens or DEFAULT_MAX_TOKENS
    if body.logprobs is not None:
        req.logprobs = body.logprobs
    if isinstance(body.prompt, str):
        req.prompt = body.prompt
    else:
        req.prompt_token_ids.ids.extend(body.prompt)
    return per_choice(req, body)


class CompletionAnswer(Answer):
    id_prefix = "cmpl-"

    def __init__(self, body: CompletionRequest, choices: Choices, model: str, codec: TextCodec):
        super().__init__(body, choices, model, codec)
        self.offsets = [0] * len(self.text)  # where each choice's next token's text begins

    def _logprob(self, index: int, entry) -> tuple[str, float, dict[str, float], int]:
        token = self.codec.token_text(entry.token_id)
        offset, self.offsets[index] = self.offsets[index], self.offsets[index] + len(token)
        top = {self.codec.token_text(t): v for t, v in zip(entry.top_ids, entry.top_logprobs)}
        return token, entry.logprob, top, offset

    def _choice_logprobs(self, entries: list) -> CompletionLogprobs | None:
        if not self.wants_logprobs:
            return None
        return CompletionLogprobs(
            tokens=[e[0] for e in entries],
            token_logprobs=[e[1] for e in entries],
            top_logprobs=[e[2] for e in entries],
            text_offset=[e[3] for e in entries],
        )

    def _completion(self, choices: list[CompletionChoice], usage=None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def _whole(self) -> Completion:
        return self._completion(
            [
                CompletionChoice(
                    index=i,
                    text=self.text[i],
                    finish_reason=self.finish[i],
                    logprobs=self._choice_logprobs(self.logprobs[i]),
                )
                for i in range(len(self.text))
            ],
            self._usage(),
        )

    def _chunk(self, index: int, delta: str, calls: list[ToolCall], logprobs: list) -> Completion:
        return self._completion(
            [
                CompletionChoice(
                    index=index, text=delta, logprobs=self._choice_logprobs(logprobs), finish_reason=self.finish[index]
                )
            ]
        )

    def _usage_chunk(self) -> Completion:
        return self._completion([], self._usage())
