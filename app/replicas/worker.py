"""A replica process: loads the backend on its placement (warmup, golden replay), runs an `LLMEngine`, and
serves the front over one duplex pipe.

Messages are tuples, pickled by `multiprocessing.connection`. From the front: `("generate", id,
prompt, params)`, `("abort", id)`, `("reset_prefix_cache",)`, `("stop",)`. To the front: `("ready",
eos_token_ids, vocab_size)` or
`("failed", message)` once, then `("outputs", [RequestOutput, ...])` (the engine's relay: a step's
deltas in one message, sent from its output thread) and `("stats", StepStats)` (the engine's stats sink).

Detokenization and stop strings run here, in the replica's own output thread: that work grows with
tokens, so it scales with the replicas instead of queueing in the one front process. SIGINT and SIGTERM
are ignored: the front drains first and then sends `stop`; a closed pipe (the front died) stops too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from multiprocessing.connection import Connection

from app.artifacts.loader import LocalArtifact
from app.device_metrics import TAG_VARIABLE
from app.engine.engine import LLMEngine
from app.engine.stats import StepStats
from app.engine.types import FinishReason, RequestOutput
from app.errors import Inf2ServeError
from app.logs import configure_logging
from app.runtime import start_engine, stop_engine
from app.settings import ServerSettings
from app.tokenizer import Tokenizer

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 10.0


class Sender:
    """The pipe's sending end, shared by the reader (rejections) and the engine's output thread."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple[object, ...]) -> None:
        with self._lock:
            self._conn.send(message)

    def outputs(self, outputs: list[RequestOutput]) -> None:
        """The engine's relay: one step's deltas in one message."""
        with contextlib.suppress(OSError):
            self.send(("outputs", outputs))

    def stats(self, stats: StepStats) -> None:
        with contextlib.suppress(OSError):  # the front is gone; the reader sees it too and stops the replica
            self.send(("stats", stats))


def run_replica(
    conn: Connection, index: int, artifact: LocalArtifact, settings: ServerSettings, runtime_tag: str
) -> None:
    """The process entry point (multiprocessing, spawn). `runtime_tag` names its Neuron runtime to
    neuron-monitor (`NEURON_PROCESS_TAG`), so that its NeuronCores are reported as this replica's."""
    os.environ[TAG_VARIABLE] = runtime_tag  # before the runtime starts, which reads it once
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(settings.log_level)
    sender = Sender(conn)
    try:
        tokenizer = Tokenizer.from_dir(artifact.root / "model")
        engine = start_engine(artifact, tokenizer, settings, sender.stats, relay=sender.outputs)
    except Exception as error:
        log.exception("replica startup failed", extra={"replica": index})
        message = error.message if isinstance(error, Inf2ServeError) else repr(error)
        sender.send(("failed", message))
        return
    try:
        _serve(conn, engine, sender)
    finally:
        stop_engine(engine, STOP_TIMEOUT_S)  # unfinished requests get their final delta first


def _serve(conn: Connection, engine: LLMEngine, sender: Sender) -> None:
    """Admit and abort as the front says, until it says stop or is gone."""
    sender.send(("ready", tuple(engine.eos_token_ids), engine.backend.model.vocab_size))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the front closed the pipe or died
            return
        kind = message[0]
        if kind == "generate":
            _, request_id, prompt, params = message
            try:
                engine.submit(request_id, prompt, params)
            except Inf2ServeError as error:
                sender.outputs([_rejected(request_id, len(prompt), error)])
        elif kind == "abort":
            engine.abort(message[1])
        elif kind == "reset_prefix_cache":
            engine.reset_prefix_cache()
        else:
            return


def _rejected(request_id: str, num_prompt_tokens: int, error: Inf2ServeError) -> RequestOutput:
    """Admission refused (bad request, queue full): the request's one and final delta."""
    return RequestOutput(request_id, (), "", (), num_prompt_tokens, 0, True, FinishReason.ERROR, error)
