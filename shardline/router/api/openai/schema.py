"""The OpenAI-compatible API's request and response bodies, as OpenAI and vLLM define them.

Requests are checked for their shape here (types, ranges OpenAI states, fields a server must
refuse rather than ignore); what depends on the served model (context, vocabulary, limits) is
checked where every front end checks it (requests/validation.py). A field this server does not
know is refused, as OpenAI refuses it, rather than ignored: a client that asks for a penalty or a
tool expects it to apply. Extensions follow vLLM's names: `top_k`, `ignore_eos`, `priority`,
`cache_salt`, `request_id`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_serializer,
    model_validator,
)

MAX_CHOICES = 16
# What a body that sets none samples with: OpenAI's defaults, which Anthropic's Messages and the
# Responses API share (their bodies are served as chat completions).
TEMPERATURE = 1.0
TOP_P = 1.0


def _number(v):
    """A JSON number (an int or a float), not a boolean or a string."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("must be a number")
    return v


Number = Annotated[float, BeforeValidator(_number)]


def unsupported(neutral):
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


class FunctionCall(Closed):
    name: StrictStr
    arguments: StrictStr  # JSON text


class ToolCall(Closed):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Closed):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class JsonSchemaFormat(Closed):
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: StrictStr | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(Closed):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        return self


class StructuredOutputs(Closed):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: dict | StrictStr | None = Field(None, alias="json")
    json_object: StrictBool | None = None
    regex: StrictStr | None = None
    grammar: StrictStr | None = None
    choice: list[StrictStr] | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        if (
            sum(
                v is not None and v is not False
                for v in (self.json_, self.json_object, self.regex, self.grammar, self.choice)
            )
            != 1
        ):
            raise ValueError("set exactly one of json, json_object, regex, grammar, choice")
        return self


class BaseRequest(Closed):
    """What chat and text completions share."""

    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0)
    top_p: Number | None = Field(None, gt=0, le=1)
    n: StrictInt = Field(1, ge=1, le=MAX_CHOICES)
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**64)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    presence_penalty: Annotated[Number | None, unsupported((None, 0))] = None
    frequency_penalty: Annotated[Number | None, unsupported((None, 0))] = None
    logit_bias: Annotated[dict[str, Number] | None, unsupported((None, {}))] = None
    # vLLM's extensions
    top_k: StrictInt | None = Field(None, ge=-1)  # -1 or 0: off
    ignore_eos: StrictBool = False
    priority: StrictInt = Field(0, ge=-(2**31), lt=2**31)
    cache_salt: StrictStr | None = None
    request_id: StrictStr | None = None
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None
    speculative: StrictBool | None = None  # Shardline's: false opts out of speculative decoding

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @model_validator(mode="after")
    def _stream_options_with_a_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _one_constraint(self):
        if (
            self.structured_outputs is not None
            and self.response_format is not None
            and self.response_format.type != "text"
        ):
            raise ValueError("response_format and structured_outputs: set one of them")
        return self


class Function(Closed):
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict | None = None  # a JSON schema of the arguments; none: any object
    strict: StrictBool | None = None


class Tool(Closed):
    type: Literal["function"]
    function: Function


class NamedFunction(Closed):
    name: StrictStr


class NamedToolChoice(Closed):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(BaseRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the chat template

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: logprobs must be true when top_logprobs is set")
        return self

    @model_validator(mode="after")
    def _tool_choice_of_the_tools(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools have the same name")
        choice = self.tool_choice
        if choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool is named {choice.function.name!r}")
        if self.calls_forced() and (
            self.structured_outputs is not None
            or self.response_format is not None
            and self.response_format.type != "text"
        ):
            raise ValueError("tool_choice: a forced tool call and a response format cannot both constrain the output")
        return self

    def calls_forced(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)


class CompletionRequest(BaseRequest):
    # A string, or token ids; or a batch of one of either.
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: Annotated[StrictBool, unsupported((False,))] = False
    suffix: Annotated[StrictStr | None, unsupported((None, ""))] = None
    best_of: Annotated[StrictInt | None, unsupported((None, 1))] = None

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


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # of completion_tokens, those of the reasoning (reasoning.py)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails = CompletionTokensDetails()


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
    content: str | None
    reasoning_content: str | None = None  # what the model reasoned before answering, as vLLM names it
    tool_calls: list[ToolCall] | None = None


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


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str = ""


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class Delta(BaseModel):
    """What a chunk adds to a choice: its role (in the first), content, or tool calls."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

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
