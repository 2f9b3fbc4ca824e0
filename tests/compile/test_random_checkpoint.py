"""Random Llama checkpoints: real Hugging Face files, deterministic weights, a tokenizer that
round-trips any text and decodes every id, and a chat template."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.backends.torch.checkpoint import check_checkpoint
from app.errors import ConfigError
from compile.random_checkpoint import PRESETS, SPECIALS, preset_from_source, write_random_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


def test_writes_a_valid_llama_checkpoint_marked_random(tiny: Path) -> None:
    spec = check_checkpoint(tiny)
    assert (spec.hidden_size, spec.num_layers, spec.vocab_size) == (64, 2, 512)
    assert spec.num_kv_heads < spec.num_heads  # GQA
    assert json.loads((tiny / "generation_config.json").read_text())["eos_token_id"] == [2]
    assert "RANDOMLY INITIALISED" in (tiny / "README.md").read_text()
    assert "chat_template" in json.loads((tiny / "tokenizer_config.json").read_text())


def test_same_seed_same_weights_other_seed_other_weights(tiny: Path, tmp_path: Path) -> None:
    def digest(path: Path) -> str:
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    assert digest(write_random_llama(tmp_path / "same")) == digest(tiny)
    assert digest(write_random_llama(tmp_path / "other", seed=1)) != digest(tiny)


def test_overrides_replace_preset_fields(tmp_path: Path) -> None:
    spec = check_checkpoint(write_random_llama(tmp_path, num_hidden_layers=1, vocab_size=400))
    assert (spec.num_layers, spec.vocab_size) == (1, 400)


def test_the_tokenizer_covers_exactly_the_model_vocabulary(tokenizer) -> None:
    assert len(tokenizer) == 512
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert None not in tokenizer.convert_ids_to_tokens(list(range(512)))
    (letter,) = tokenizer.convert_tokens_to_ids(["a"])
    # Every non-special id adds text (after a letter: a lone space is stripped as the leading one).
    assert all(len(tokenizer.decode([letter, i])) > 1 for i in range(3, 512))


@settings(max_examples=60, deadline=None)
# Text holding a special token's string ('<s>') is read as that token, so it does not round-trip.
@given(st.text(max_size=40).filter(lambda text: not any(s in text for s in SPECIALS)))
def test_any_text_round_trips(tokenizer, text: str) -> None:
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == 1 and max(ids) < 512
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_the_chat_template_renders(tokenizer) -> None:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<s>### user:\nHi there\n### assistant:\n"


def test_presets_are_llama_shaped() -> None:
    big = PRESETS["100m"]
    hidden, inter, layers, vocab = (
        big[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
    )
    kv = big["num_key_value_heads"] * big["head_dim"]
    params = 2 * vocab * hidden + layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter)
    assert 90e6 < params < 110e6 and vocab == 32000 and big["max_position_embeddings"] == 2048
    assert preset_from_source("random:100m") == "100m"
    with pytest.raises(ConfigError, match="unknown random model preset 'huge'"):
        preset_from_source("random:huge")
