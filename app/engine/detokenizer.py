"""Incremental detokenization: generated ids in, text pieces out, such that the pieces always concatenate
to the decoded text of all the ids (continuing the prompt's text).

Text is held back while later ids could still change it:
- a run of byte-fallback tokens (sentencepiece `<0xNN>`) is rendered as a whole by the decoder, and one
  invalid byte turns the whole run into U+FFFD characters, so nothing is emitted while the ids end in
  byte (or skipped special) tokens;
- an incomplete UTF-8 sequence (byte-level BPE, Llama 3) decodes to a trailing U+FFFD.
Sentencepiece decoders also strip the leading space of the first token. So each step decodes only the new
stable ids behind an anchor, a plain-text token standing in for the text before them, and emits the
text after the anchor's own. Before any text exists (an empty prompt) there is nothing to continue, and
the window starts at the first generated id instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from app.errors import ConfigError

if TYPE_CHECKING:
    from app.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True, slots=True)
class DecodeRules:
    """What incremental detokenization needs from a tokenizer, computed once per engine."""

    decode: Callable[[list[int]], str]
    hold_ids: frozenset[int]  # byte-fallback and special ids: the text they end in may still change
    anchor: tuple[int, ...]  # one plain-text token
    anchor_len: int  # len(decode(anchor))

    @classmethod
    def of(cls, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> DecodeRules:
        """`skip_special_tokens=False`: special tokens' text is part of the output text."""
        anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
        anchor_text = tokenizer.decode(anchor)
        if not anchor_text or REPLACEMENT_CHAR in anchor_text or anchor_text[0].isspace():
            raise ConfigError(f"the tokenizer has no plain-text token for 'a' (got {anchor_text!r})")
        special = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        return cls(
            decode=partial(tokenizer.decode, skip_special_tokens=skip_special_tokens),
            hold_ids=tokenizer.byte_fallback_ids | special,
            anchor=tuple(anchor),
            anchor_len=len(anchor_text),
        )

    def continues_text(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether generated text follows some prompt text (then its first space is kept)."""
        return bool(self.decode(list(prompt_token_ids[-8:]))) or bool(self.decode(list(prompt_token_ids)))

    def token_text(self, token_id: int) -> str:
        """One token's text as it reads inside a text, its leading space kept (decoded behind the anchor)."""
        return self.decode([*self.anchor, token_id])[self.anchor_len :]


class IncrementalDetokenizer:
    """One request's generated ids to text pieces; `push` per step, `flush` once at the end."""

    __slots__ = ("_anchor", "_anchor_len", "_ids", "_read", "_rules")

    def __init__(self, rules: DecodeRules, continues_text: bool) -> None:
        self._rules = rules
        self._ids: list[int] = []
        self._read = 0  # ids[:_read] are accounted for in the emitted text
        self._anchor: tuple[int, ...] = rules.anchor if continues_text else ()
        self._anchor_len = rules.anchor_len if continues_text else 0

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new ids; return the text that became stable."""
        self._ids.extend(token_ids)
        end = len(self._ids)
        hold_ids = self._rules.hold_ids
        while end > self._read and self._ids[end - 1] in hold_ids:
            end -= 1
        return self._emit(end, final=False) if end > self._read else ""

    def flush(self) -> str:
        """The text still held back, once no more ids will come."""
        return self._emit(len(self._ids), final=True) if len(self._ids) > self._read else ""

    def _emit(self, end: int, final: bool) -> str:
        start = self._read if self._anchor else 0
        text = self._rules.decode([*self._anchor, *self._ids[start:end]])
        if not final and text.endswith(REPLACEMENT_CHAR):
            return ""
        piece = text[self._anchor_len :]
        self._read = end
        if piece and not self._anchor:
            self._anchor, self._anchor_len = self._rules.anchor, self._rules.anchor_len
        return piece
