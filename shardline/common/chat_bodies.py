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
  `cache_control` is moot (every prefix is cached). `thinking` `{"type": "disabled"}` asks the
  chat template for no reasoning (`enable_thinking` false, Qwen3's variable), `enabled` for it.
- tools: `input_schema` is the function's parameters; tool_choice `auto`, `any` (a call is
  required), `tool` (that one), `none`; `disable_parallel_tool_use` is `parallel_tool_calls`
  false; `output_config.format` is `response_format`.

OpenAI's Responses API (`/v1/responses`):
- `instructions` is a system message first; `input` (a string: one user message) and the items
  of the conversation `previous_response_id` continues (the caller's to look up) are messages:
  `message` items (text parts joined), `function_call` items the tool calls of an assistant
  message, `function_call_output` items tool messages; `reasoning` items are left out.
- tools are flat (`name` beside `type`), tool_choice `{"type": "function", "name"}` names one;
  `text.format` is `response_format`, `max_output_tokens` is `max_tokens`, and
  `message.output_text.logprobs` in `include` asks for log-probabilities (`top_logprobs` of them).
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
    # Unset, temperature and top_p take the chat default, which is Anthropic's too.
    for name, to in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stop_sequences", "stop"),
    ):
        if body.get(name) is not None:
            chat[to] = body[name]
    if (body.get("metadata") or {}).get("user_id"):
        chat["user"] = body["metadata"]["user_id"]
    thinking = (body.get("thinking") or {}).get("type")
    if thinking in ("enabled", "disabled"):
        chat["chat_template_kwargs"] = {"enable_thinking": thinking == "enabled"}
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
    if body.get("structured_outputs"):
        chat["structured_outputs"] = body["structured_outputs"]
    if body.get("tool_choice"):
        chat["tool_choice"] = _anthropic_tool_choice(body["tool_choice"])
        if body["tool_choice"].get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    return chat


# -- OpenAI's Responses API (`/v1/responses`) ------------------------------------------------------
def _part_text(content) -> str:
    """A message's text: a string, or its text parts (`input_text`, `output_text`, `refusal`)."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", p.get("refusal", "")) for p in content or [])


def _items_as_messages(items: list[dict]) -> list[dict]:
    """Responses' items as chat messages. An assistant's `function_call` items are tool calls of
    one assistant message, with the text of the assistant message just before them (one answer
    written as both, as chat completions answers it); `function_call_output` items are tool
    messages; `reasoning` items are left out (the prompt is what the model would have read)."""
    out: list[dict] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item["role"], "content": _part_text(item["content"])})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _part_text(item["output"])})
    return out


def _responses_tool_choice(choice):
    if isinstance(choice, dict):  # {"type": "function", "name": ...}
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _text_format(fmt: dict) -> dict:
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": schema}


def responses_as_chat(body: dict, history: list[dict]) -> dict:
    """A Responses body as a chat completion body. `history`: the items of the conversation its
    `previous_response_id` names (the earlier requests' input items and their output items, in
    order), which come before its own input; `instructions` is a system message first (an
    earlier request's instructions are not carried over, as OpenAI states)."""
    messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    items = body["input"]
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    messages += _items_as_messages([*history, *items])
    chat = {"model": body["model"], "messages": messages, "stream": body.get("stream", False)}
    for name, to in (("temperature", "temperature"), ("top_p", "top_p"), ("max_output_tokens", "max_tokens")):
        if body.get(name) is not None:
            chat[to] = body[name]
    if body.get("tools"):
        chat["tools"] = [
            {
                "type": "function",
                "function": {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None},
            }
            for t in body["tools"]
        ]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _responses_tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("structured_outputs"):
        chat["structured_outputs"] = body["structured_outputs"]
    fmt = (body.get("text") or {}).get("format")
    if fmt:
        chat["response_format"] = _text_format(fmt)
    if "message.output_text.logprobs" in (body.get("include") or []):
        chat["logprobs"] = True
        chat["top_logprobs"] = body.get("top_logprobs") or 0
    return chat
