"""Other APIs' request bodies as the chat completion body that asks for the same generation: the
one translation a router serves them by and a gateway hashes their prompts by, so both compute
exactly the same prompt. Plain JSON data in and out; the input has passed its API's schema (a
router) or is read as far as it goes (a gateway: a KeyError, TypeError or ValueError means
"route by load").

Anthropic's Messages API (`/v1/messages`):
- `system` (text or text blocks) is a system message; text blocks of a message are joined.
- An assistant message's `tool_use` blocks are its tool calls (`input` as JSON arguments); a user
  message's `tool_result` blocks are tool messages answering them, in block order, its text a
  user message after them.
- `thinking` blocks of earlier turns are left out (the prompt is what the model would have read);
  `cache_control` is moot (every prefix is cached).
- tools: `input_schema` is the function's parameters; tool_choice `auto`, `any` (a call is
  required), `tool` (that one), `none`; `disable_parallel_tool_use` is `parallel_tool_calls`
  false; `output_config.format` is `response_format`.
"""

from __future__ import annotations

import json


def _text(content) -> str:
    """A string, or the text of a list of blocks (other blocks are the caller's to refuse)."""
    if isinstance(content, str):
        return content
    return "".join(b["text"] for b in content or [] if b.get("type") == "text")


def _anthropic_message(m: dict) -> list[dict]:
    content = m["content"]
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if m["role"] == "assistant":
        calls = [
            {
                "id": b["id"],
                "type": "function",
                "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)},
            }
            for b in content
            if b.get("type") == "tool_use"
        ]
        message = {"role": "assistant", "content": _text(content)}
        return [{**message, "tool_calls": calls} if calls else message]
    out, text = [], ""
    for b in content:
        if b.get("type") == "tool_result":
            if text:
                out.append({"role": "user", "content": text})
                text = ""
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": _text(b.get("content"))})
        elif b.get("type") == "text":
            text += b["text"]
    return [*out, {"role": "user", "content": text}] if text or not out else out


def _anthropic_tool_choice(choice: dict) -> str | dict:
    kind = choice["type"]
    if kind == "tool":
        return {"type": "function", "function": {"name": choice["name"]}}
    return {"any": "required"}.get(kind, kind)


def messages_as_chat(body: dict) -> dict:
    """An Anthropic Messages body as a chat completion body: the conversation, tools and
    sampling (the caller sets what depends on the served model: max_tokens)."""
    messages = []
    if body.get("system"):
        messages.append({"role": "system", "content": _text(body["system"])})
    for m in body["messages"]:
        messages.extend(_anthropic_message(m))
    chat = {"model": body["model"], "messages": messages, "stream": body.get("stream", False)}
    chat["temperature"] = body.get("temperature", 1.0)  # Anthropic's default
    for name, to in (("top_p", "top_p"), ("top_k", "top_k"), ("stop_sequences", "stop")):
        if body.get(name) is not None:
            chat[to] = body[name]
    if (body.get("metadata") or {}).get("user_id"):
        chat["user"] = body["metadata"]["user_id"]
    if body.get("tools"):
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    k: v
                    for k, v in (
                        ("name", t["name"]),
                        ("description", t.get("description")),
                        ("parameters", t["input_schema"]),
                    )
                    if v is not None
                },
            }
            for t in body["tools"]
        ]
    output_format = (body.get("output_config") or {}).get("format")
    if output_format:
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": output_format["schema"]},
        }
    if body.get("tool_choice"):
        chat["tool_choice"] = _anthropic_tool_choice(body["tool_choice"])
        if body["tool_choice"].get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    return chat
