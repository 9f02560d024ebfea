"""Anthropic's Messages API bodies, as Anthropic defines them (its Python client 2.x). As Anthropic
does (and as openai/schema.py does), a field this server does not know is refused; what it cannot
honour is refused with a message: images and documents (the served models read text), a last
assistant message (prefill: the chat template opens a new turn), server tools. Accepted and moot:
`cache_control` (every prefix is cached), `thinking` and earlier turns' thinking blocks (a model
that does not think writes none), `output_config.effort`, `service_tier`, `speed`,
`inference_geo`, a tool's `strict` (calls are always valid: they are constrained),
`defer_loading`, `eager_input_streaming`, `input_examples`. `output_config.format` (a JSON schema)
constrains the text as chat completions' `response_format` does; `structured_outputs` (not
Anthropic's: vLLM's, as chat completions takes it) constrains it by any of its kinds (a regex, a
grammar, ...). `temperature`, `top_p` and `top_k`, which Anthropic's client no longer names, are
taken as older clients send them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr, model_validator

from shardline.router.api.openai.schema import Closed, Number


class CacheControl(Closed):
    type: Literal["ephemeral"]
    ttl: StrictStr | None = None


class TextBlock(Closed):
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl | None = None
    citations: list[dict] | None = None


class ImageBlock(Closed):
    type: Literal["image", "document"]
    source: dict
    cache_control: CacheControl | None = None


class ToolUseBlock(Closed):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict
    cache_control: CacheControl | None = None


class ToolResultBlock(Closed):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = None
    is_error: StrictBool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(Closed):
    type: Literal["thinking", "redacted_thinking"]
    thinking: StrictStr | None = None
    signature: StrictStr | None = None
    data: StrictStr | None = None


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(Closed):
    role: Literal["user", "assistant"]
    content: StrictStr | list[Block]

    @model_validator(mode="after")
    def _blocks_of_its_role(self):
        blocks = self.content if isinstance(self.content, list) else []
        kinds = {b.type for b in blocks}
        kinds |= {r.type for b in blocks if b.type == "tool_result" and isinstance(b.content, list) for r in b.content}
        if kinds & {"image", "document"}:
            raise ValueError("image and document blocks are not supported: the served model reads text")
        if self.role == "user" and kinds & {"tool_use", "thinking", "redacted_thinking"}:
            raise ValueError("tool_use and thinking blocks belong to assistant messages")
        if self.role == "assistant" and "tool_result" in kinds:
            raise ValueError("tool_result blocks belong to user messages")
        return self


class Tool(Closed):
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: StrictStr | None = None
    input_schema: dict
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, ...) are not run here
    cache_control: CacheControl | None = None
    strict: StrictBool | None = None
    defer_loading: StrictBool | None = None
    eager_input_streaming: StrictBool | None = None
    input_examples: list[dict] | None = None
    allowed_callers: list[StrictStr] | None = None


class ToolChoice(Closed):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is required with type 'tool', and only with it")
        return self


class Metadata(Closed):
    user_id: StrictStr | None = None


class Thinking(Closed):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: StrictInt | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(Closed):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(Closed):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(Closed):
    model: StrictStr
    messages: list[Message] = Field(min_length=1)
    system: StrictStr | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None

    @model_validator(mode="after")
    def _tool_choice_of_the_tools(self):
        names, choice = [t.name for t in self.tools or []], self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice: {choice.type!r} needs tools")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice: no tool is named {choice.name!r}")
        return self

    @model_validator(mode="after")
    def _no_prefill(self):
        if self.messages[-1].role == "assistant":
            raise ValueError("messages: the last message is the assistant's; prefill is not supported by this server")
        return self


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool = False
    temperature: Number | None = Field(None, ge=0, le=1)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: StrictStr | None = None
    structured_outputs: dict | None = None  # checked as chat completions' (openai/schema.py)


# -- answers ---------------------------------------------------------------------------------------
class Usage(BaseModel):
    input_tokens: int  # not read from the prefix cache (Anthropic's accounting)
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageAnswer(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
