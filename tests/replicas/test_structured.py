"""Grammar-constrained requests through `inf2serve serve --replicas 2` (sim device, stories260K's
tokenizer, requests alternating between the replicas): a constraint crosses to a replica process as plain
data and each replica makes its own matchers, so every output matches its constraint whichever replica
served it (a made-up logits row on the sim matches only because the grammar leaves it no other choice)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.replicas.helpers import serve_two_replicas

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
    },
    "required": ["kind", "legs"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "maybe"]
PER_CONSTRAINT = 6  # round robin: three of each on each replica


async def completions(url: str, constraint: dict[str, Any]) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        bodies = [
            {"prompt": "Once upon a time", "max_tokens": 60, "temperature": 1.0, "seed": seed, **constraint}
            for seed in range(PER_CONSTRAINT)
        ]
        responses = await asyncio.gather(*(client.post("/v1/completions", json=body) for body in bodies))
    assert [r.status_code for r in responses] == [200] * PER_CONSTRAINT, [r.text for r in responses]
    return [r.json()["choices"][0]["text"] for r in responses]


def test_grammar_requests_on_two_replicas_match_their_constraints(sim_artifact: Path, tmp_path: Path) -> None:
    server = serve_two_replicas(
        sim_artifact, tmp_path, "--replica-routing", "round_robin", "--no-verify-golden"
    )
    try:
        server.wait_ready()
        choices = asyncio.run(completions(server.url, {"guided_choice": CHOICES}))
        documents = asyncio.run(completions(server.url, {"guided_json": SCHEMA}))
    finally:
        server.stop()
    assert set(choices) <= set(CHOICES), choices
    for text in documents:
        jsonschema.validate(json.loads(text), SCHEMA)
