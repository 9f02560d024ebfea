"""The served model's tokenizer, chat template and streaming detokenizer, without torch.

`tokenizers` reads `tokenizer.json`; jinja2 renders the chat template as `transformers` does (a
sandbox, trim_blocks and lstrip_blocks, `raise_exception`, a `tojson` that keeps non-ASCII);
`tokenizers.decoders.DecodeStream` turns sampled tokens into text deltas.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _bytes_to_unicode()
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class TemplateError(ValueError):
    """The chat template refused the conversation (its own `raise_exception`, or a render error)."""


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


HARMONY_ENDS = ("<|return|>", "<|call|>")


def speaks_harmony(template_source: str | None) -> bool:
    """Whether a chat template has its model write harmony messages (gpt-oss's)."""
    return bool(template_source) and "<|channel|>" in template_source and "<|message|>" in template_source


class TextCodec:
    """Text <-> token ids for one model folder (tokenizer.json + tokenizer_config.json)."""

    def __init__(self, folder: Path):
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.special = {k: _token_text(config.get(k)) or "" for k in _SPECIAL}
        eos = self.special["eos_token"]
        eos_id = self.tokenizer.token_to_id(eos) if eos else None
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self._template = None
        self.template_source: str | None = template or None
        # gpt-oss's harmony messages (router/api/harmony.py): a turn ends at <|return|> or <|call|>
        self.harmony = speaks_harmony(template)
        # the markers the router reads that are special tokens of their models' vocabularies stay
        # in the text: harmony's, and Mistral's [TOOL_CALLS] and [ARGS] (router/api/openai/tools.py)
        self.keeps_special = self.harmony or "[TOOL_CALLS]" in (template or "")
        ends = [self.tokenizer.token_to_id(t) for t in HARMONY_ENDS] if self.harmony else []
        self.end_token_ids = frozenset(i for i in (eos_id, *ends) if i is not None)
        if template:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
            self._template = env.from_string(template)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        # The most characters one token stands for: a prompt longer than context x this cannot fit.
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        self.max_token_chars = max(len(self.tokenizer.decode([i], skip_special_tokens=False)) for i in vocab.values())
        self._byte_level = json.loads(self.tokenizer.to_str()).get("decoder", {}).get("type") == "ByteLevel"
        self._special_ids = {
            self.tokenizer.token_to_id(t.content)
            for t in self.tokenizer.get_added_tokens_decoder().values()
            if t.special
        }

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL (plain encode holds it for the whole text), so a long
        # prompt tokenized on a worker thread does not stall the event loop.
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, variables: dict | None = None) -> str:
        """The conversation as the model reads it; `tools` (OpenAI's definitions) go to the
        template as transformers hands them over, and `variables` beside them (chat template
        kwargs: Qwen3's `enable_thinking`)."""
        if self._template is None:
            raise TemplateError("the model has no chat template; send a prompt or token ids instead")
        own = {"messages", "tools", "add_generation_prompt", *self.special}
        if taken := sorted(own & set(variables or {})):
            raise TemplateError(f"chat template kwargs may not set the template's own {', '.join(taken)}")
        try:
            return self._template.render(
                messages=messages, tools=tools, add_generation_prompt=True, **self.special, **(variables or {})
            )
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"the chat template refused the messages: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise TemplateError(f"the chat template failed on the messages: {e!r}") from e

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level token may hold half a character); a
        special token's are its text."""
        piece = self.tokenizer.id_to_token(token_id) or ""
        if token_id in self._special_ids:
            return piece.encode()
        if self._byte_level:
            return bytes(_BYTE_OF_CHAR[c] for c in piece if c in _BYTE_OF_CHAR)
        if m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):  # SentencePiece's byte fallback
            return bytes([int(m[1], 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word boundary

    def token_text(self, token_id: int) -> str:
        """One token's text as the OpenAI API shows it (half a character as U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def stream(self) -> Detokenizer:
        return Detokenizer(self.tokenizer, keep_special=self.keeps_special)


class Detokenizer:
    """Text deltas for a growing list of token ids. A token that ends inside a UTF-8 character
    yields nothing until the token completing it arrives; special tokens yield nothing, unless
    `keep_special` (their text)."""

    def __init__(self, tokenizer: Tokenizer, keep_special: bool = False):
        self.tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=not keep_special)

    def push(self, token_id: int) -> str:
        return self._stream.step(self.tokenizer, token_id) or ""
