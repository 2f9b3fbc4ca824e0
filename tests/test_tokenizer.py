"""The tokenizer wrapper on the real stories260K tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.errors import ConfigError
from app.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(stories260k: Path) -> Tokenizer:
    return Tokenizer.from_dir(stories260k)


def test_encodes_with_bos_and_decodes_back(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Once upon a time, a café €")
    assert ids[0] == tokenizer.bos_token_id == 1
    assert tokenizer.decode(ids) == "Once upon a time, a café €"
    assert tokenizer.decode(ids, skip_special_tokens=False).startswith("<s>")


def test_eos_ids_come_from_the_generation_config(tokenizer: Tokenizer) -> None:
    assert tokenizer.eos_token_ids == (1, 2)


def test_knows_its_special_and_byte_fallback_ids(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 512 and tokenizer.special_token_ids == {0, 1, 2}
    assert tokenizer.byte_fallback_ids == set(range(3, 259))


def test_a_base_model_gets_the_plain_chat_template(tokenizer: Tokenizer) -> None:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids.count(1) == 1 and ids[0] == 1  # one BOS, from the template
    assert tokenizer.decode(ids) == "user: Hi\nassistant:"


def test_a_directory_without_a_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        Tokenizer.from_dir(tmp_path)
