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
    assert ids[0] == 1  # BOS
    assert tokenizer.decode(ids) == "Once upon a time, a café €"
    assert tokenizer.decode(ids, skip_special_tokens=False).startswith("<s>")


def test_eos_ids_come_from_the_generation_config(tokenizer: Tokenizer) -> None:
    assert tokenizer.eos_token_ids == (1, 2)


def test_knows_its_special_and_byte_fallback_ids(tokenizer: Tokenizer) -> None:
    assert tokenizer.special_token_ids == {0, 1, 2}
    assert tokenizer.byte_fallback_ids == set(range(3, 259))


def test_a_base_model_gets_the_plain_chat_template(tokenizer: Tokenizer) -> None:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids.count(1) == 1 and ids[0] == 1  # one BOS, from the template
    assert tokenizer.decode(ids) == "user: Hi\nassistant:"


def test_the_plain_template_renders_tools_calls_and_results(tokenizer: Tokenizer) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"d": 1}}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    ids = tokenizer.apply_chat_template(messages, template_kwargs={"tools": [tool]})
    assert tokenizer.renders_tools
    assert tokenizer.decode(ids) == (
        'tools: [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]\n'
        'user: Hi\nassistant: {"name": "f", "parameters": {"d": 1}}; {"name": "f", "parameters": {"d": 1}}\n'
        "tool: sunny\nassistant:"
    )


def test_a_directory_without_a_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot load a tokenizer.*tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


TEXTS = ["Once upon a time", " leading space", "digits 12345 and\ttabs\nnewlines", "café €, 日本語 🙂", ""]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Tell me a story"},
]


@pytest.fixture(scope="module")
def random_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from compile.random_checkpoint import write_random_llama

    return write_random_llama(tmp_path_factory.mktemp("random-tiny"), "tiny")


@pytest.mark.parametrize("model", ["stories260k", "random_tokenizer_dir"])
def test_encoding_and_chat_template_match_transformers(model: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoTokenizer

    path = request.getfixturevalue(model)
    ours, reference = (
        Tokenizer.from_dir(path),
        AutoTokenizer.from_pretrained(str(path), local_files_only=True),
    )
    for text in TEXTS:
        assert ours.encode(text) == list(reference.encode(text)), text
        assert ours.encode(text, add_special_tokens=False) == list(
            reference.encode(text, add_special_tokens=False)
        ), text
    rendered = reference.apply_chat_template(
        CONVERSATION, chat_template=ours.chat_template, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(CONVERSATION) == list(
        reference.encode(rendered, add_special_tokens=False)
    )
