"""Reading a server's streamed completions in tests: the events of one stream, signalling its first."""

from __future__ import annotations

import asyncio

import httpx


async def stream_events(
    client: httpx.AsyncClient, started: asyncio.Event, max_tokens: int
) -> tuple[int, list[str]]:
    """Stream one `max_tokens` completion (EOS ignored); `started` is set at its first event. Returns the
    status and every event's data."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    return response.status_code, events
