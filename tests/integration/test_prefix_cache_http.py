"""Prefix caching through the real server (torch backend, stories260K, two API keys), driven by the official
`openai` client: a repeated prompt reports its cached tokens in `usage` and the hit in `/metrics`; the API
key and `cache_salt` isolate tenants; `POST /reset_prefix_cache` needs a key and empties the cache."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.harness.server import BIN, ServerProcess, free_port

pytestmark = pytest.mark.slow

KEYS = ("tenant-one-key", "tenant-two-key")
PROMPT = (
    "Once upon a time, there was a little girl named Lily. She liked to play in the park with her dog. " * 2
)


@pytest.fixture(scope="module")
def server(stories_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("prefix-cache")
    shutil.copytree(stories_artifact, root / "model")
    port = free_port()
    env = {
        "SAGEMAKER_BIND_TO_PORT": str(port),
        "INF2SERVE_ARTIFACT": str(root / "model"),
        "INF2SERVE_API_KEYS": ",".join(KEYS),
        "INF2SERVE_DRAIN_S": "0",
    }
    process = ServerProcess([str(BIN / "serve")], env, port, root / "server.log").start()
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def complete(server: ServerProcess, key: str, **extra: object) -> int:
    """A completion of PROMPT under `key`; its cached prompt tokens."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
    completion = client.completions.create(
        model="stories260K", prompt=PROMPT, max_tokens=2, temperature=0, extra_body=extra or None
    )
    assert completion.usage is not None and completion.usage.prompt_tokens > 32
    assert completion.usage.prompt_tokens_details is not None
    return completion.usage.prompt_tokens_details.cached_tokens or 0


def metric(server: ServerProcess, name: str) -> float:
    families = text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
    return sum(s.value for f in families for s in f.samples if s.name == name)


def reset(server: ServerProcess, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/reset_prefix_cache", headers=headers).status_code


def test_a_repeated_prompt_reports_its_cached_tokens_and_the_hit_in_metrics(server: ServerProcess) -> None:
    assert reset(server, KEYS[0]) == 200
    hits = metric(server, "inf2serve_prefix_cache_hits_total")
    assert complete(server, KEYS[0]) == 0
    cached = complete(server, KEYS[0])
    assert cached > 0
    assert metric(server, "inf2serve_prefix_cache_hits_total") == hits + cached
    assert metric(server, "inf2serve_prefix_cache_queries_total") > metric(
        server, "inf2serve_prefix_cache_hits_total"
    )


def test_tenants_and_salts_never_hit_each_others_prefixes(server: ServerProcess) -> None:
    assert reset(server, KEYS[0]) == 200
    assert complete(server, KEYS[0]) == 0
    assert complete(server, KEYS[1]) == 0  # another key: its own salt
    assert complete(server, KEYS[0], cache_salt="private") == 0
    assert complete(server, KEYS[0], cache_salt="private") > 0
    assert complete(server, KEYS[1]) > 0


def test_reset_needs_a_key_and_empties_the_cache(server: ServerProcess) -> None:
    complete(server, KEYS[0])
    assert complete(server, KEYS[0]) > 0
    assert reset(server, None) == 401
    assert complete(server, KEYS[0]) > 0
    assert reset(server, KEYS[1]) == 200
    assert complete(server, KEYS[0]) == 0
