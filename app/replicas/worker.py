"""A replica process: loads the backend on its placement (warmup, golden replay; `app/runtime.py`), runs an
`LLMEngine`, and serves the front over one duplex pipe (messages: `app/replicas/messages.py`).

Three threads of its own: the main thread reads the pipe (admit, abort, reset the prefix cache, stop),
the engine's output thread sends each step's deltas and statistics, and a heartbeat thread sends the
engine's readiness and measured rates every HEARTBEAT_S. An engine whose loop has died cannot recover:
the heartbeat thread ends the process, the front sees the pipe close and restarts it (the requests that
handed out nothing move to another replica), so a replica with a dead engine never takes traffic.

Detokenization and stop strings run here, in the replica's own output thread: that work grows with
tokens, so it scales with the replicas instead of queueing in the one front process. SIGINT and SIGTERM
are ignored: the front drains first and then sends `Stop`; a closed pipe (the front died) stops too.
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
from app.engine.types import RequestOutput, final_error
from app.errors import Inf2ServeError
from app.logs import configure_logging
from app.replicas.messages import (
    HEARTBEAT_S,
    Abort,
    Failed,
    FromReplica,
    Generate,
    Heartbeat,
    Outputs,
    Ready,
    ResetPrefixCache,
    Stats,
)
from app.runtime import start_engine, stop_engine
from app.settings import ServerSettings
from app.tokenizer import Tokenizer

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 10.0
EXIT_ENGINE_DIED = 70  # EX_SOFTWARE: the engine loop failed; the front restarts the replica


class Sender:
    """The pipe's sending end, shared by the main thread (rejections), the engine's output thread and
    the heartbeat thread."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self.engine: LLMEngine | None = None  # once started: its measured rates go with stats

    def send(self, message: FromReplica) -> None:
        with contextlib.suppress(OSError), self._lock:  # the front is gone: the main thread sees it too
            self._conn.send(message)

    def outputs(self, outputs: list[RequestOutput]) -> None:
        """The engine's relay: one step's deltas in one message."""
        self.send(Outputs(outputs))

    def stats(self, stats: StepStats) -> None:
        self.send(Stats(stats, *self.rates()))

    def rates(self) -> tuple[float, float, float]:
        """The engine's measured output share, decode step and prefill stall (`Backlog.fill`, `.token_s`,
        `.prefill_s`)."""
        if self.engine is None:
            return 1.0, 0.0, 0.0
        backlog = self.engine.backlog()
        return backlog.fill, backlog.token_s, backlog.prefill_s


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
        sender.send(Failed(error.message if isinstance(error, Inf2ServeError) else repr(error)))
        return
    sender.engine = engine
    stopping = threading.Event()
    try:
        backend = engine.backend
        ready = Ready(
            tuple(engine.eos_token_ids),
            backend.model.vocab_size,
            backend.name,
            backend.sampling_features,
            *sender.rates(),
        )
        sender.send(ready)
        heartbeat = threading.Thread(
            target=_beat, args=(engine, sender, stopping, index), name="inf2serve-heartbeat", daemon=True
        )
        heartbeat.start()
        _serve(conn, engine, sender)
    finally:
        stopping.set()
        stop_engine(engine, STOP_TIMEOUT_S)  # unfinished requests get their final delta first


def _beat(engine: LLMEngine, sender: Sender, stopping: threading.Event, index: int) -> None:
    """Every HEARTBEAT_S: the engine's state to the front; the process's end if the engine died."""
    while not stopping.wait(HEARTBEAT_S):
        if not engine.is_alive and not stopping.is_set():
            log.error(
                "the engine loop died: ending the replica, for the front to restart", extra={"replica": index}
            )
            os._exit(EXIT_ENGINE_DIED)
        sender.send(Heartbeat(engine.is_ready, *sender.rates()))


def _serve(conn: Connection, engine: LLMEngine, sender: Sender) -> None:
    """Admit and abort as the front says, until it says stop or is gone."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the front closed the pipe or died
            return
        match message:
            case Generate(request_id, prompt, params):
                try:
                    engine.submit(request_id, prompt, params)
                except Inf2ServeError as error:
                    sender.outputs([final_error(request_id, len(prompt), 0, error)])  # refused
            case Abort(request_id):
                engine.abort(request_id)
            case ResetPrefixCache():
                engine.reset_prefix_cache()
            case _:
                return
