"""The served model's tokenizer, loaded from a directory (an artifact's `model/`): the Rust `tokenizers`
library on `tokenizer.json`, and the chat template from `tokenizer_config.json` (or `chat_template.jinja`)
rendered in a sandboxed jinja2 environment, as transformers does. The server never imports transformers:
that import alone took seconds of every startup.

The HTTP layer encodes prompts and renders chat templates with it, off the event loop (`encode` goes
through the Rust library's batch call, which releases the GIL, so a long prompt stalls no other thread);
the engine decodes with `decode` and uses the id sets below for incremental detokenization.

User text is encoded as text: a special token's string (`"</s>"`) in a prompt or in chat content stays
plain text, and control tokens come only from the tokenizer's own template (BOS) or the chat template,
as Meta's reference chat format does. A completion may opt in to reading them (`split_special_tokens`).

EOS ids come from `generation_config.json` when present (Llama 3 and stories260K list several there),
else from the tokenizer config.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import pre_tokenizers

from app.errors import ConfigError, InvalidRequestError
from app.llama import generation_eos_ids

# NOTE: used only when the tokenizer ships no chat template (base models such as stories260K): plain
# "role: content" lines and an open assistant turn, BOS first as the model expects. Tools follow Hugging
# Face's convention, so a base model serves tool calls too: the offered functions as one JSON line first,
# an assistant's calls in Llama 3.1's JSON form (what the `llama3_json` parser reads back), `;` between.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}{{ '; ' if not loop.first }}"
    "{{ {'name': call['function']['name'], 'parameters': call['function']['arguments']} | tojson }}"
    "{% endfor %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_MARKER = re.compile("\ue000(\\d+)\ue001")  # stands for message i's content while the template renders
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(
        self, rust: RustTokenizer, config: Mapping[str, Any], chat_template: str | None, eos: tuple[int, ...]
    ) -> None:
        self._rust = rust
        self._text = _as_text(rust, first=True)
        self._text_after_special = _as_text(rust, first=False)
        self.special_tokens = {name: _content(config.get(name)) for name in _SPECIAL_NAMES}
        self.chat_template = chat_template or FALLBACK_CHAT_TEMPLATE
        self.eos_token_ids = eos or _ids_of(rust, [self.special_tokens["eos_token"]])
        self.special_token_ids = frozenset(
            i for i, token in rust.get_added_tokens_decoder().items() if token.special
        )
        self.byte_fallback_ids = frozenset(
            i for token, i in rust.get_vocab(with_added_tokens=False).items() if _BYTE_TOKEN.fullmatch(token)
        )
        specials = {t.content: i for i, t in rust.get_added_tokens_decoder().items() if t.special}
        self._special_ids = specials
        self._special_pattern = (
            re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
            if specials
            else None
        )
        # No token covers more characters of input than its own string has: a text of more than
        # max_token_chars * n characters has more than n tokens (the cheap check before tokenizing).
        self.max_token_chars = max(len(token) for token in rust.get_vocab(with_added_tokens=True)) + 1
        self.vocab_size = rust.get_vocab_size(with_added_tokens=True)
        self.tokenizer_class = str(config.get("tokenizer_class") or "PreTrainedTokenizerFast")

    @classmethod
    def from_dir(cls, path: Path, chat_template: Path | None = None) -> Tokenizer:
        """`chat_template`: a Jinja file rendered instead of the directory's template."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(
                f"cannot load a tokenizer from {path}: it has no tokenizer.json (a fast tokenizer)"
            )
        try:
            rust = RustTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the Rust library raises plain Exceptions for malformed files
            raise ConfigError(f"cannot load a tokenizer from {path}: {exc}") from exc
        config = _read_json(path / "tokenizer_config.json")
        template = _read_template(chat_template) if chat_template else _chat_template(path, config)
        return cls(rust, config, template, generation_eos_ids(path))

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` holds it (for libraries that take one: the grammar engine)."""
        return self._rust.to_str()

    def encode(
        self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of `text`, with BOS (and any other special prefix) as the model expects when
        `add_special_tokens`; special-token strings in `text` stay text unless `split_special_tokens` is
        false. The batch call releases the GIL while it runs."""
        rust = self._text if split_special_tokens else self._rust
        return rust.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids`, without any space clean-up (so decoding is a pure function of the ids,
        which incremental detokenization relies on)."""
        return self._rust.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template reads the `tools` variable (Hugging Face's tool-use convention)."""
        return "tools" in self.chat_template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation. The template writes the special prefix (BOS) itself,
        so the rendered text is encoded without adding another; special tokens come only from the
        template, never from a message's content."""
        if self._special_pattern is None or not any(
            self._special_pattern.search(m["content"]) for m in messages
        ):
            text = self._render(messages, add_generation_prompt, template_kwargs)
            return self._rust.encode_batch([text], add_special_tokens=False)[0].ids
        marked = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
        rendered = self._render(marked, add_generation_prompt, template_kwargs)
        return self._encode_pieces(_pieces(rendered, [m["content"] for m in messages], self._special_pattern))

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None,
    ) -> str:
        try:
            return self._template.render(
                **(template_kwargs or {}),
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **{name: token or "" for name, token in self.special_tokens.items()},
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}", "messages") from exc

    def _encode_pieces(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """Text pieces encoded as text, special pieces as their ids: what the library does when it
        splits a text at its special tokens, with only the template's ones counted as special."""
        ids: list[int] = []
        for position, (piece, special) in enumerate(pieces):
            if special:
                ids.append(self._special_ids[piece])
            elif piece:
                rust = self._text if position == 0 else self._text_after_special
                ids += rust.encode_batch([piece], add_special_tokens=False)[0].ids
        return ids

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent
        )
        return env.from_string(self.chat_template)


def _pieces(rendered: str, contents: list[str], specials: re.Pattern[str]) -> list[tuple[str, bool]]:
    """`(text, is_special)` pieces of a rendered template whose contents are markers: the template's own
    text split at special tokens, each message's content put back as plain text."""
    pieces: list[tuple[str, bool]] = []
    text = ""
    for i, part in enumerate(_MARKER.split(rendered)):
        if i % 2:  # a marker's group: the message index
            text += contents[int(part)]
            continue
        start = 0
        for match in specials.finditer(part):
            pieces += [(text + part[start : match.start()], False), (match.group(), True)]
            text, start = "", match.end()
        text += part[start:]
    return [*pieces, (text, False)]


def _as_text(rust: RustTokenizer, first: bool) -> RustTokenizer:
    """A copy of `rust` that reads special-token strings as text. `first=False`: for a piece that follows a
    special token, where a sentencepiece pre-tokenizer that marks only the text's start ("first") adds no
    leading space marker."""
    copy = RustTokenizer.from_str(rust.to_str())
    copy.encode_special_tokens = True
    pre = copy.pre_tokenizer
    if not first and isinstance(pre, pre_tokenizers.Metaspace) and pre.prepend_scheme == "first":
        copy.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=pre.replacement, prepend_scheme="never", split=pre.split
        )
    return copy


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _content(token: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(token, dict):
        return str(token.get("content"))
    return None if token is None else str(token)


def _ids_of(rust: RustTokenizer, tokens: list[str | None]) -> tuple[int, ...]:
    ids = (rust.token_to_id(token) for token in tokens if token)
    return tuple(i for i in ids if i is not None)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _read_template(path: Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"cannot read the chat template {path}: {error}") from error


def _chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    """transformers 5 saves the template as chat_template.jinja; older versions inside the config."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template
