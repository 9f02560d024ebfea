"""A GenerateRequest's prompt as token ids: the router admits them, and a gateway hashes them
to find the replica that caches their prefix, so both compute exactly the same ids."""

from __future__ import annotations

import json

from shardline.common.tokenizer import TextCodec
from shardline.protos import generation_pb2 as pb


def template_message(m: pb.ChatMessage) -> dict:
    """A message as a chat template reads it (as transformers hands it over: a tool call's
    arguments as an object where they are JSON)."""
    entry = {"role": m.role, "content": m.content}
    if m.tool_calls_json:
        entry["tool_calls"] = calls = json.loads(m.tool_calls_json)
        for call in calls:
            function = call.get("function", {})
            try:
                function["arguments"] = json.loads(function.get("arguments", ""))
            except (TypeError, ValueError):
                pass  # not JSON: the template gets the text
    for name in ("tool_call_id", "name"):
        if getattr(m, name):
            entry[name] = getattr(m, name)
    return entry


def prompt_ids(codec: TextCodec, req: pb.GenerateRequest) -> list[int]:
    """Tokenizes (and templates) the request's input. Raises TemplateError (and ValueError for a
    tool list that is not JSON, which validation refuses first)."""
    kind = req.WhichOneof("input")
    if kind == "prompt_token_ids":
        return list(req.prompt_token_ids.ids)
    if kind == "prompt":
        return codec.encode(req.prompt)
    chat = [template_message(m) for m in req.messages.messages]
    tools = json.loads(req.messages.tools_json) if req.messages.tools_json else None
    variables = json.loads(req.messages.template_kwargs_json) if req.messages.template_kwargs_json else None
    return codec.encode(codec.render_chat(chat, tools, variables))
