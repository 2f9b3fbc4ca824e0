"""A replica process: loads the backend on its placement (warmup, golden replay), runs an `LLMEngine`, and
serves the front over one duplex pipe.

Messages are tuples, pickled by `multiprocessing.connection`. From the front: `("generate", id,
prompt, params)`, `("abort", id)`, `("stop",)`. To the front: `("ready", eos_token_ids, vocab_size)` or
`("failed", message)` once, then `("outputs", [RequestOutput, ...])` (every delta the engine handed out in one
event-loop turn, so one message per step, not per token) and `("stats", StepStats)` (the engine's stats sink).

Detokenization and stop strings run here, in the replica's own output thread: that work grows with
tokens, so it scales with the replicas instead of queueing in the one front process. SIGINT and SIGTERM
are ignored: the front drains first and then sends `stop`; a closed pipe (the front died) stops too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection

from app.api import startup  # a module, not its names: startup imports the pool, which imports this
from app.api.logs import configure_logging
from app.artifacts.loader import LocalArtifact
from app.engine.engine import LLMEngine
from app.engine.stats import StepStats
from app.engine.types import FinishReason, RequestOutput
from app.errors import Inf2ServeError
from app.settings import ServerSettings
from app.tokenizer import Tokenizer

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 10.0


class Sender:
    """The pipe's sending end, shared by the event loop and the engine's output thread."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple[object, ...]) -> None:
        with self._lock:
            self._conn.send(message)

    def stats(self, stats: StepStats) -> None:
        with contextlib.suppress(OSError):  # the front is gone; the reader sees it too and stops the replica
            self.send(("stats", stats))


class Outbox:
    """Collects the deltas of one event-loop turn and sends them as one message at its end."""

    def __init__(self, sender: Sender, loop: asyncio.AbstractEventLoop) -> None:
        self._sender = sender
        self._loop = loop
        self._outputs: list[RequestOutput] = []

    def put(self, output: RequestOutput) -> None:
        if not self._outputs:
            self._loop.call_soon(self._flush)
        self._outputs.append(output)

    def _flush(self) -> None:
        outputs, self._outputs = self._outputs, []
        with contextlib.suppress(OSError):
            self._sender.send(("outputs", outputs))


def run_replica(conn: Connection, index: int, artifact: LocalArtifact, settings: ServerSettings) -> None:
    """The process entry point (multiprocessing, spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(settings.log_level)
    sender = Sender(conn)
    try:
        tokenizer = Tokenizer.from_dir(artifact.root / "model")
        backend = startup.load_backend(artifact, settings)
    except Exception as error:
        log.exception("replica startup failed", extra={"replica": index})
        message = error.message if isinstance(error, Inf2ServeError) else repr(error)
        sender.send(("failed", message))
        return
    engine = LLMEngine(backend, tokenizer, settings.engine_config(), stats_sink=sender.stats)
    try:
        engine.start()
        asyncio.run(_serve(conn, engine, sender))
    finally:
        engine.stop(timeout=STOP_TIMEOUT_S)
        backend.close()


async def _serve(conn: Connection, engine: LLMEngine, sender: Sender) -> None:
    loop = asyncio.get_running_loop()
    outbox = Outbox(sender, loop)
    stopping = asyncio.Event()
    forwards: set[asyncio.Task[None]] = set()

    def on_message(message: tuple[object, ...]) -> None:
        kind = message[0]
        if kind == "generate":
            _, request_id, prompt, params = message
            try:
                stream = engine.generate(request_id, prompt, params)  # type: ignore[arg-type]
            except Inf2ServeError as error:
                outbox.put(_rejected(str(request_id), len(prompt), error))  # type: ignore[arg-type]
                return
            task = loop.create_task(_forward(stream, outbox))
            forwards.add(task)
            task.add_done_callback(forwards.discard)
        elif kind == "abort":
            engine.abort(str(message[1]))
        else:
            stopping.set()

    def read() -> None:
        try:
            while True:
                loop.call_soon_threadsafe(on_message, conn.recv())
        except (EOFError, OSError):  # the front closed the pipe or died
            loop.call_soon_threadsafe(stopping.set)

    threading.Thread(target=read, name="inf2serve-replica-reader", daemon=True).start()
    sender.send(("ready", tuple(engine.eos_token_ids), engine.backend.model.vocab_size))
    await stopping.wait()
    # Unfinished requests get their final delta (NotReadyError) from the engine's stop.
    await asyncio.to_thread(engine.stop, STOP_TIMEOUT_S)
    if forwards:
        await asyncio.wait(forwards, timeout=STOP_TIMEOUT_S)
    await asyncio.sleep(0)  # the outbox's last flush


async def _forward(stream: AsyncIterator[RequestOutput], outbox: Outbox) -> None:
    async for output in stream:
        outbox.put(output)


def _rejected(request_id: str, num_prompt_tokens: int, error: Inf2ServeError) -> RequestOutput:
    """Admission refused (bad request, queue full): the request's one and final delta."""
    return RequestOutput(request_id, (), "", (), num_prompt_tokens, 0, True, FinishReason.ERROR, error)
