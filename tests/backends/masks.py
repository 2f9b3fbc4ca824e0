"""Grammar matchers for tests of the host logits path (`app.backends.logits.TokenMask`)."""

from __future__ import annotations

import numpy


class FixedTokens:
    """A grammar matcher that allows a fixed set of tokens at every step, of a `vocab`-token vocabulary."""

    def __init__(self, tokens: tuple[int, ...], vocab: int) -> None:
        self.tokens, self.vocab = tokens, vocab

    def fill(self, masks: list[FixedTokens]) -> numpy.ndarray:
        words = numpy.zeros((len(masks), (self.vocab + 31) // 32), numpy.uint32)
        for row, mask in enumerate(masks):
            for token in mask.tokens:
                words[row, token // 32] |= numpy.uint32(1 << (token % 32))
        return words.view(numpy.int32)

    def accept(self, token_id: int) -> None:
        pass

    def allows(self, token_id: int) -> bool:
        return token_id in self.tokens

    def known_next(self) -> int | None:
        return None
