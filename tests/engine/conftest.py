"""Fixtures for the engine tests: the real stories260K tokenizer (it has byte-fallback tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer(stories260k: Path) -> Tokenizer:
    return Tokenizer.from_dir(stories260k)
