"""The prompt set a canary is judged on, and its replay against one endpoint.

Prompts come from an artifact's `golden.json` (sent as token ids, so tokenization cannot differ between
the two servers; `max_tokens` is the golden length) plus an optional file: one prompt per line, or a
JSON object per line with `prompt` and optional `max_tokens`. Each prompt goes to `/v1/completions`,
greedy (temperature 0). Agreement compares the returned text: two servers that decode the same greedy
token ids with the same tokenizer return the same text, and text works against any OpenAI server.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import httpx

from app.artifacts.golden import Golden
from app.errors import ConfigError

DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Prompt:
    prompt: str | list[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Reply:
    """One prompt's outcome on one endpoint: `text`, or why there is none (`error`)."""

    text: str | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.text is not None


def golden_prompts(golden: Golden) -> list[Prompt]:
    return [Prompt(list(p.prompt_token_ids), max(1, len(p.token_ids))) for p in golden.prompts]


def file_prompts(path: Path) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            prompts.append(Prompt(line, DEFAULT_MAX_TOKENS))
            continue
        try:
            record = json.loads(line)
            prompts.append(Prompt(str(record["prompt"]), int(record.get("max_tokens", DEFAULT_MAX_TOKENS))))
        except (ValueError, KeyError, TypeError) as error:
            raise ConfigError(
                f"{path}:{number}: expected a prompt or a JSON object with 'prompt': {error}"
            ) from None
    return prompts


async def _send(client: httpx.AsyncClient, model: str | None, prompt: Prompt) -> Reply:
    body: dict[str, object] = {"prompt": prompt.prompt, "max_tokens": prompt.max_tokens, "temperature": 0.0}
    if model is not None:
        body["model"] = model
    try:
        response = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as error:
        return Reply(None, f"{type(error).__name__}: {error}")
    if response.status_code != 200:
        return Reply(None, f"HTTP {response.status_code}: {response.text[:200]}")
    return Reply(response.json()["choices"][0]["text"])


async def replay(
    client: httpx.AsyncClient, prompts: list[Prompt], concurrency: int, model: str | None = None
) -> list[Reply]:
    """Every prompt once, at most `concurrency` in flight; replies in prompt order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: Prompt) -> Reply:
        async with gate:
            return await _send(client, model, prompt)

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def scrape(client: httpx.AsyncClient) -> str:
    response = await client.get("/metrics")
    response.raise_for_status()
    return response.text
