"""Shared by the replica tests: an event loop on its own thread (a pool outlives one `asyncio.run`), the
request parameters, the collectors, and a two-replica server process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from app.backends.base import SamplingParams
from app.engine.types import GenerationParams, RequestOutput
from loadtest.harness.server import BIN, ServerProcess, free_port

T = TypeVar("T")
TIMEOUT_S = 120.0  # a bound on a hang: spawning replicas takes tens of seconds on a loaded host
PROMPT = (5, 6, 7, 8)


class LoopThread:
    """An event loop on a thread of its own, for a client that outlives one `asyncio.run`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="contract-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, TIMEOUT_S), self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT_S)
        self.loop.close()


def params(max_tokens: int, **sampling: Any) -> GenerationParams:
    return GenerationParams(SamplingParams(seed=1, **sampling), max_tokens, ignore_eos=True)


async def collect(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [output async for output in stream]


async def until(condition: Callable[[], bool]) -> None:
    """Wait for `condition()` to hold (the caller's timeout bounds it)."""
    while not condition():
        await asyncio.sleep(0.01)


def serve_two_replicas(artifact: Path, log_dir: Path, *flags: str) -> ServerProcess:
    """`inf2serve serve --replicas 2` on `artifact` with `flags`, started (wait for it to be ready)."""
    port = free_port()
    argv = [str(BIN / "inf2serve"), "serve", "--artifact", str(artifact), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--replicas", "2", *flags]
    return ServerProcess(argv, {}, port, log_dir / "server.log").start()
