"""The served model's tokenizer, loaded from a directory (an artifact's `model/`): the Rust `tokenizers`
library on `tokenizer.json`, and the chat template from `tokenizer_config.json` (or `chat_template.jinja`)
rendered in a sandboxed jinja2 environment, as transformers does. The server never imports transformers:
that import alone took seconds of every startup.

The HTTP layer encodes prompts and renders chat templates with it, outside the engine loop; the engine
decodes with `decode` and uses the id sets below for incremental detokenization. EOS ids come from
`generation_config.json` when present (Llama 3 and stories260K list several there), else from the
tokenizer config.
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

from app.errors import ConfigError, InvalidRequestError

# NOTE: used only when the tokenizer ships no chat template (base models such as stories260K): plain
# "role: content" lines and an open assistant turn, BOS first as the model expects.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(
        self, rust: RustTokenizer, config: Mapping[str, Any], chat_template: str | None, eos: tuple[int, ...]
    ) -> None:
        self._rust = rust
        self.special_tokens = {name: _content(config.get(name)) for name in _SPECIAL_NAMES}
        self.chat_template = chat_template or FALLBACK_CHAT_TEMPLATE
        self.eos_token_ids = eos or _ids_of(rust, [self.special_tokens["eos_token"]])
        self.special_token_ids = frozenset(
            i for i, token in rust.get_added_tokens_decoder().items() if token.special
        )
        self.byte_fallback_ids = frozenset(
            i for token, i in rust.get_vocab(with_added_tokens=False).items() if _BYTE_TOKEN.fullmatch(token)
        )

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
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
        return cls(rust, config, _chat_template(path, config), _generation_eos(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with BOS (and any other special prefix) as the model expects."""
        return self._rust.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids`, without any space clean-up (so decoding is a pure function of the ids,
        which incremental detokenization relies on)."""
        return self._rust.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered conversation. The template writes the special prefix (BOS) itself,
        so the rendered text is encoded without adding another."""
        try:
            text = self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **{name: token or "" for name, token in self.special_tokens.items()},
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}", "messages") from exc
        return self.encode(text, add_special_tokens=False)

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


def _chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    """transformers 5 saves the template as chat_template.jinja; older versions inside the config."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


def _generation_eos(path: Path) -> tuple[int, ...]:
    eos = _read_json(path / "generation_config.json").get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(i) for i in eos) if isinstance(eos, list) else (int(eos),)
