"""vLLM's `/tokenize` and `/detokenize`: a prompt (text, or chat messages through the model's
chat template, exactly as a completion would compute it) as token ids, and token ids as text,
special tokens included (as vLLM's: a tokenized prompt detokenizes to its text).
Bodies as vLLM defines them; the options vLLM has and this server does not are refused at any
value but their default (openai/schema.py's rule)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictBool, StrictInt, StrictStr, model_validator

from shardline.common.tokenizer import TextCodec
from shardline.protos import generation_pb2 as pb
from shardline.router.api.openai.chat import chat_messages
from shardline.router.api.openai.schema import Closed, Message, Tool, unsupported


class TokenizeRequest(Closed):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    return_token_strs: StrictBool = False
    add_special_tokens: Annotated[StrictBool | None, unsupported((None, True))] = None
    add_generation_prompt: Annotated[StrictBool, unsupported((True,))] = True

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("set exactly one of prompt and messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools: only with messages")
        return self


class DetokenizeRequest(Closed):
    model: StrictStr | None = None
    tokens: list[StrictInt]


def prompt_request(body: TokenizeRequest, id_chars: int = 0) -> pb.GenerateRequest:
    """The prompt a body would be served with; `id_chars`: as chat completions render call ids."""
    if body.prompt is not None:
        return pb.GenerateRequest(prompt=body.prompt)
    return pb.GenerateRequest(messages=chat_messages(body.messages, body.tools, id_chars))


def tokenized(body: TokenizeRequest, ids: list[int], context_length: int, codec: TextCodec) -> dict:
    """vLLM's TokenizeResponse."""
    answer = {"count": len(ids), "max_model_len": context_length, "tokens": ids, "token_strs": None}
    if body.return_token_strs:
        answer["token_strs"] = [codec.tokenizer.id_to_token(t) for t in ids]  # as vLLM: the vocabulary's pieces
    return answer
