"""vLLM's tokenizer routes on a real server with stories260K's tokenizer, through the clients that call
them unmodified: `/tokenize` then `/detokenize` returns the text, and lm-evaluation-harness's remote
tokenizer (`tokenizer_backend=remote`, what its `local-completions` model uses without a local
tokenizer) finds `/tokenizer_info` and encodes and decodes as transformers' tokenizer does; a chat
prompt's count takes its tools, as the completion's usage does."""

from __future__ import annotations

import httpx
import pytest
from lm_eval.utils import RemoteTokenizer
from transformers import AutoTokenizer

TEXT = "Once upon a time, there was a little girl named Lily. She liked </s> and ünïcödé."


@pytest.mark.parametrize("split_special_tokens", [False, True])
def test_tokenize_then_detokenize_returns_the_text(sim_server, split_special_tokens) -> None:
    body = {"prompt": TEXT, "add_special_tokens": False, "split_special_tokens": split_special_tokens}
    tokens = httpx.post(sim_server.url + "/tokenize", json=body)
    assert tokens.status_code == 200 and tokens.json()["count"] == len(tokens.json()["tokens"])
    text = httpx.post(sim_server.url + "/detokenize", json={"tokens": tokens.json()["tokens"]})
    assert text.json() == {"prompt": TEXT}


@pytest.fixture(scope="module")
def reference(stories260k) -> AutoTokenizer:
    return AutoTokenizer.from_pretrained(str(stories260k))


def test_lm_evals_remote_tokenizer_finds_the_routes(sim_server, reference) -> None:
    remote = RemoteTokenizer(sim_server.url + "/v1/completions")
    assert remote.eos_token == reference.eos_token and remote.bos_token == reference.bos_token
    assert remote.encode(TEXT) == reference.encode(TEXT, add_special_tokens=False)
    assert remote.decode(remote.encode(TEXT)) == TEXT
    assert remote.eos_token_id == reference.eos_token_id


def test_tokenize_counts_a_chat_prompt_with_its_tools(sim_server) -> None:
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    chat = {"messages": [{"role": "user", "content": "What time is it?"}], "tools": [tool]}
    counted = httpx.post(sim_server.url + "/tokenize", json=chat)
    completion = httpx.post(sim_server.url + "/v1/chat/completions", json={**chat, "max_tokens": 1})
    without = httpx.post(sim_server.url + "/tokenize", json={"messages": chat["messages"]}).json()["count"]
    assert counted.json()["count"] == completion.json()["usage"]["prompt_tokens"] > without
