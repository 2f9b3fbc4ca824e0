"""The served model's tokenizer: a thin wrapper over Hugging Face's fast tokenizer, loaded from a directory
(an artifact's `model/`).

The HTTP layer encodes prompts and renders chat templates with it, outside the engine loop; the engine
decodes with `decode` (the Rust decoder, called directly) and uses the id sets below for incremental
detokenization. EOS ids come from `generation_config.json` when present (Llama 3 and stories260K list
several there), else from the tokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from app.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# NOTE: used only when the tokenizer ships no chat template (base models such as stories260K): plain
# "role: content" lines and an open assistant turn, BOS first as the model expects.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class Tokenizer:
    def __init__(self, hf: PreTrainedTokenizerBase, eos_token_ids: tuple[int, ...]) -> None:
        if not getattr(hf, "is_fast", False):
            raise ConfigError(f"{type(hf).__name__} is not a fast tokenizer; ship a tokenizer.json")
        self.hf = hf
        self._rust = hf.backend_tokenizer
        self.eos_token_ids = eos_token_ids
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size = len(hf)
        self.special_token_ids = frozenset(hf.all_special_ids)
        self.byte_fallback_ids = frozenset(
            i for token, i in hf.get_vocab().items() if _BYTE_TOKEN.fullmatch(token)
        )

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load a tokenizer from {path}: {exc}") from exc
        return cls(hf, _eos_token_ids(Path(path), hf))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with BOS (and any other special prefix) as the model expects."""
        return list(self.hf.encode(text))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids`, without the tokenizer's space clean-up (so decoding is a pure function
        of the ids, which incremental detokenization relies on)."""
        return self._rust.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered conversation. The template writes the special prefix (BOS) itself,
        so the rendered text is encoded without adding another."""
        text = self.hf.apply_chat_template(
            [dict(m) for m in messages],
            chat_template=self.hf.chat_template or FALLBACK_CHAT_TEMPLATE,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return list(self.hf.encode(text, add_special_tokens=False))


def _eos_token_ids(path: Path, hf: PreTrainedTokenizerBase) -> tuple[int, ...]:
    generation_config = path / "generation_config.json"
    if generation_config.exists():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return () if hf.eos_token_id is None else (hf.eos_token_id,)
