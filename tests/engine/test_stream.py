"""`RequestStream`: one request's deltas handed from the engine (or the replica pool) to its reader."""

from __future__ import annotations

import asyncio

from app.engine.output import RequestStream
from app.engine.types import FinishReason, RequestOutput


def delta(generated: int, finished: bool = False) -> RequestOutput:
    reason = FinishReason.LENGTH if finished else None
    return RequestOutput("r", (generated,), f"t{generated}", (), 3, generated, finished, reason)


async def read_while_putting(read_at_end: bool) -> tuple[list[int], list[int]]:
    """Put two deltas and then the final one; what the reader had before the final, and in the end."""
    stream = RequestStream("r", asyncio.get_running_loop(), lambda request_id: None, read_at_end)
    seen: list[int] = []

    async def read() -> None:
        async for output in stream:
            seen.append(output.num_generated_tokens)

    reader = asyncio.create_task(read())
    await asyncio.sleep(0)  # the reader waits for its first delta
    for generated in (1, 2):
        stream.put(delta(generated))
        await asyncio.sleep(0)  # a woken reader runs here
        await asyncio.sleep(0)
    before_final = list(seen)
    stream.put(delta(3, finished=True))
    await reader
    return before_final, seen


def test_a_streamed_reader_gets_each_delta_as_it_comes() -> None:
    before_final, seen = asyncio.run(read_while_putting(read_at_end=False))
    assert before_final == [1, 2]
    assert seen == [1, 2, 3]


def test_a_reader_at_the_end_is_woken_once_and_gets_every_delta_in_order() -> None:
    before_final, seen = asyncio.run(read_while_putting(read_at_end=True))
    assert before_final == []
    assert seen == [1, 2, 3]
