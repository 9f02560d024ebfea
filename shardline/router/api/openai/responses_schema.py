"""OpenAI's Responses API bodies (`/v1/responses`), as OpenAI's Python client 3.x defines them.

As openai/schema.py does, a field this server does not know is refused, and so is what it cannot
honour: images, files and audio (the served models read text), items of OpenAI's hosted tools
(web search, file search, computer use, code interpreter, MCP, shell), tools other than
functions, `truncation: "auto"`, `background`, stored prompts and conversations.

Accepted and moot, because what Codex CLI and the OpenAI Agents SDK send must be served:
`reasoning` (a model that does not reason writes no reasoning items) and earlier turns'
`reasoning` items (left out of the prompt), `include` (`reasoning.encrypted_content` and the
hosted tools' outputs have nothing to add; `message.output_text.logprobs` is honoured),
`text.verbosity`, `service_tier`, `prompt_cache_key` and `prompt_cache_retention` (every prefix
is cached), `stream_options.include_obfuscation` (no obfuscation is sent), `metadata` (echoed),
`user`, `safety_identifier`, `client_metadata`, `max_tool_calls` (it limits hosted tools), an
item's `id`, `status` and `phase`, a text part's `annotations`, `logprobs` and
`prompt_cache_breakpoint`, a function tool's `strict` (calls are always valid: constrained).
Beside OpenAI's fields, vLLM's `structured_outputs` constrains the text as in chat completions.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    model_validator,
)

from shardline.router.api.openai.schema import Closed, Number, unsupported

Status = Literal["in_progress", "completed", "incomplete"]


class TextOr:
    """`TextOr[X]`: a string or a list of X, refused with the errors of the form sent alone."""

    def __class_getitem__(cls, item):
        return Annotated[
            Annotated[StrictStr, Tag("str")] | Annotated[list[item], Tag("list")],
            Discriminator(lambda v: "str" if isinstance(v, str) else "list"),
        ]


class TextContent(Closed):
    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list[dict] | None = None
    logprobs: list[dict] | None = None
    prompt_cache_breakpoint: dict | None = None
    id: StrictStr | None = None


class Refusal(Closed):
    type: Literal["refusal"]
    refusal: StrictStr


class Media(BaseModel):
    """An image, file or audio part: refused, whatever it holds."""

    model_config = ConfigDict(extra="allow")
    type: Literal["input_image", "input_file", "input_audio"]

    @model_validator(mode="after")
    def _refused(self):
        raise ValueError(f"{self.type} is not supported: the served model reads text")


Content = Annotated[TextContent | Refusal | Media, Field(discriminator="type")]


class MessageItem(Closed):
    type: Literal["message"]
    role: Literal["user", "assistant", "system", "developer"]
    content: TextOr[Content]
    id: StrictStr | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Closed):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr  # JSON text
    id: StrictStr | None = None
    status: Status | None = None


class FunctionCallOutputItem(Closed):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: TextOr[Content]
    id: StrictStr | None = None
    status: Status | None = None


class ReasoningItem(Closed):
    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[dict] = []
    content: list[dict] | None = None
    encrypted_content: StrictStr | None = None
    status: Status | None = None


def _typed(items):
    """The short form of a message, `{"role", "content"}`, is a `message` item."""
    if isinstance(items, list):
        return [{"type": "message", **i} if isinstance(i, dict) and "type" not in i else i for i in items]
    return items


Item = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Field(discriminator="type")]


class FunctionTool(Closed):
    type: Literal["function"]
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict | None = None  # a JSON schema of the arguments; none: any object
    strict: StrictBool | None = None


class NamedFunction(Closed):
    type: Literal["function"]
    name: StrictStr


class PlainText(Closed):
    type: Literal["text"]


class JsonObject(Closed):
    type: Literal["json_object"]


class JsonSchema(Closed):
    type: Literal["json_schema"]
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict = Field(alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextConfig(Closed):
    format: Annotated[PlainText | JsonObject | JsonSchema, Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(Closed):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(Closed):
    include_obfuscation: StrictBool | None = None


Includable = Literal[
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
    "message.input_image.image_url",
    "web_search_call.action.sources",
    "web_search_call.results",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
]


class ResponsesRequest(Closed):
    model: StrictStr
    input: Annotated[TextOr[Item], BeforeValidator(_typed)]
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    include: list[Includable] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    store: StrictBool | None = None  # none: true, as OpenAI's
    metadata: dict[StrictStr, StrictStr] | None = Field(None, max_length=16)
    user: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    reasoning: Reasoning | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = None
    max_tool_calls: StrictInt | None = Field(None, ge=1)
    client_metadata: dict[StrictStr, StrictStr] | None = None  # Codex CLI's
    structured_outputs: dict | None = None  # not OpenAI's: vLLM's, checked as chat completions' (schema.py)
    truncation: Annotated[Literal["auto", "disabled"] | None, unsupported((None, "disabled"))] = None
    background: Annotated[StrictBool | None, unsupported((None, False))] = None
    _history: list[dict] = PrivateAttr(default_factory=list)

    @property
    def stores(self) -> bool:
        return self.store is not False

    @property
    def history(self) -> list[dict]:
        """The items of the conversation `previous_response_id` names, before this input: not
        the client's to send, but the server's to look up (responses.py, once per request)."""
        return self._history

    @history.setter
    def history(self, items: list[dict]) -> None:
        self._history = items

    @model_validator(mode="after")
    def _stream_options_with_a_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _tool_choice_of_the_tools(self):
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools have the same name")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs tools")
        if isinstance(self.tool_choice, NamedFunction) and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice: no tool is named {self.tool_choice.name!r}")
        return self


# -- answers ---------------------------------------------------------------------------------------
class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    input_tokens: int  # the whole prompt; what the prefix cache held in input_tokens_details
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class Response(BaseModel):
    """The Response object; its id first, where a gateway reads it (gateway/response_homes.py)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict | None = None
    incomplete_details: dict | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[dict]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict
    store: bool
    temperature: float
    text: dict
    tool_choice: str | dict
    tools: list[dict]
    top_logprobs: int
    top_p: float
    truncation: str = "disabled"
    usage: Usage | None
    user: str | None
    metadata: dict
    background: bool = False
    service_tier: str = "default"
    prompt_cache_key: str | None
    safety_identifier: str | None
