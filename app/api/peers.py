"""What one front process asks the others (`--api-servers`, app/api/fronts.py), so that whichever front a
probe or a scrape reaches answers for the whole server:
- readiness (`/ready`, `/ping`): ready only while every front is ready, since any front may be handed the
  next connection. A front that does not answer within PEER_TIMEOUT_S counts as not ready.
- `/metrics`: every front's samples, each labelled `api_server` (app/metrics.py `render_merged`);
- `/reset_prefix_cache`: every front's replicas forget their cached prefixes.

Each front answers on a Unix socket in the supervisor's private directory: one question per connection,
a line naming it, answered with one pickled value. Only the fronts of this server, running as the same
user, can reach that directory. Liveness (`/health`) stays each front's own: a front that cannot recover
exits, and the supervisor then stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
from collections.abc import Callable
from typing import Any

from prometheus_client import Metric

from app import metrics
from app.api.fronts import ApiServer
from app.api.state import ServerState

log = logging.getLogger(__name__)

PEER_TIMEOUT_S = 0.5  # a probe that asks its peers still answers within SageMaker's 2 s

READY = b"ready"
METRICS = b"metrics"
RESET_PREFIX_CACHE = b"reset_prefix_cache"


class Peers:
    def __init__(self, api_server: ApiServer, state: ServerState) -> None:
        self.api_server = api_server
        self.state = state
        self._listener: asyncio.Server | None = None
        self._answers: dict[bytes, Callable[[], Any]] = {
            READY: lambda: (state.ready, state.status),
            METRICS: metrics.families,
            RESET_PREFIX_CACHE: self._reset_own_prefix_cache,
        }

    async def start(self) -> None:
        """Answer the other fronts (from startup on: a starting front says so)."""
        if self.api_server.peers:
            path = self.api_server.socket_path(self.api_server.index)
            self._listener = await asyncio.start_unix_server(self._answer, path=str(path))

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            await self._listener.wait_closed()

    async def readiness(self) -> tuple[bool, str]:
        """This front's readiness and status, unless it is ready and another front is not."""
        if not self.state.ready:
            return False, self.state.status
        for index, answer in zip(self.api_server.peers, await self._ask_all(READY), strict=True):
            if answer is None:
                return False, f"front {index} is not answering"
            if not answer[0]:
                return False, f"front {index} is {answer[1]}"
        return True, self.state.status

    async def render_metrics(self) -> bytes:
        """The Prometheus text of this front, or with peers, of every front that answered."""
        if not self.api_server.peers:
            return metrics.render()
        by_front: dict[int, list[Metric]] = {self.api_server.index: metrics.families()}
        for index, families in zip(self.api_server.peers, await self._ask_all(METRICS), strict=True):
            if families is None:
                log.warning("a front did not answer for /metrics", extra={"front": index})
            else:
                by_front[index] = families
        return await asyncio.to_thread(metrics.render_merged, by_front)

    async def reset_prefix_cache(self) -> None:
        """Every front's replicas forget their cached prefixes (a front that does not answer: logged)."""
        self._reset_own_prefix_cache()
        for index, done in zip(self.api_server.peers, await self._ask_all(RESET_PREFIX_CACHE), strict=True):
            if done is None:
                log.warning("a front did not answer to reset its prefix cache", extra={"front": index})

    def _reset_own_prefix_cache(self) -> bool:
        if self.state.runtime is not None:
            self.state.runtime.engine.reset_prefix_cache()
        return True

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.closing(writer):
            question = (await reader.readline()).strip()
            answer = self._answers.get(question)
            if answer is not None:
                writer.write(pickle.dumps(answer()))
                await writer.drain()

    async def _ask_all(self, question: bytes) -> list[Any]:
        return await asyncio.gather(*(self._ask(index, question) for index in self.api_server.peers))

    async def _ask(self, index: int, question: bytes) -> Any:
        """A peer's answer, or None where it does not give one in time."""
        path = str(self.api_server.socket_path(index))
        try:
            async with asyncio.timeout(PEER_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(path)
                with contextlib.closing(writer):
                    writer.write(question + b"\n")
                    return pickle.loads(await reader.read())
        except (OSError, TimeoutError, EOFError, pickle.UnpicklingError):
            return None
