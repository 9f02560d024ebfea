"""The OpenAI-compatible API's request and response bodies, as OpenAI and vLLM define them.

Requests are checked for their shape here (types, ranges OpenAI states, fields a server must
refuse rather than ignore); what depends on the served model (context, vocabulary, limits) is
checked where every front end checks it (router/validation.py). A field this server does not
know is refused, as OpenAI refuses it, rather than ignored: a client that asks for a penalty or a
tool expects it to apply. Extensions follow vLLM's names: `top_k`, `ignore_eos`, `priority`,
`cache_salt`, `request_id`.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      field_validator, model_serializer, model_validator)

MAX_CHOICES = 16


def _number(v):
    """A JSON number (an int or a float), not a boolean or a string."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("must be a number")
    return v


Number = Annotated[float, BeforeValidator(_number)]


def _unsupported(neutral):
    """A field this server accepts at its neutral value only (what a client sends when it
    means none), and refuses otherwise."""
    def check(v):
        if v not in neutral:
            raise ValueError("is not supported by this server")
        return v
    return AfterValidator(check)


class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Closed):
    include_usage: StrictBool = False


class TextPart(Closed):
    type: Literal["text"]
    text: StrictStr


class Message(Closed):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class Sampling(Closed):
    """What chat and text completions share."""

    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0)
    top_p: Number | None = Field(None, gt=0, le=1)
    n: StrictInt = Field(1, ge=1, le=MAX_CHOICES)
    seed: StrictInt | None = Field(None, ge=-2**63, lt=2**64)
    stop: Union[StrictStr, list[StrictStr], None] = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    presence_penalty: Annotated[Number | None, _unsupported((None, 0))] = None
    frequency_penalty: Annotated[Number | None, _unsupported((None, 0))] = None
    logit_bias: Annotated[dict[str, Number] | None, _unsupported((None, {}))] = None
    # vLLM's extensions
    top_k: StrictInt | None = Field(None, ge=-1)     # -1 or 0: off
    ignore_eos: StrictBool = False
    priority: StrictInt = Field(0, ge=-2**31, lt=2**31)
    cache_salt: StrictStr | None = None
    request_id: StrictStr | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @model_validator(mode="after")
    def _stream_options_with_a_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    # until constraints and tool calls exist
    response_format: Annotated[dict | None, _unsupported((None, {"type": "text"}))] = None
    tools: Annotated[list | None, _unsupported((None, []))] = None
    tool_choice: Annotated[StrictStr | None, _unsupported((None, "none", "auto"))] = None

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: logprobs must be true when top_logprobs is set")
        return self


class CompletionRequest(Sampling):
    # A string, or token ids; or a batch of one of either.
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: Annotated[StrictBool, _unsupported((False,))] = False
    suffix: Annotated[StrictStr | None, _unsupported((None, ""))] = None
    best_of: Annotated[StrictInt | None, _unsupported((None, 1))] = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("a batch of prompts is not supported: send one prompt per request")
            return v[0]
        return v


# -- responses -------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    """The legacy format of text completions."""

    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    """What a chunk adds to a choice: its role (in the first), or content."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _present(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "shardline"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class Error(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: Error
