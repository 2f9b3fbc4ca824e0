"""The front's side of the replicas: `ReplicaPool` starts one process per placement (app/replicas/worker.py),
routes each request to one (app/replicas/router.py), relays its deltas, records every replica's
`StepStats` under its `replica` label, restarts a replica that dies, and stops them all on shutdown. It is
the `EngineClient` the HTTP layer talks to, as a single `LLMEngine` is.

IPC: one `multiprocessing` duplex pipe per replica (stdlib, pickled tuples). Each side has one reader
thread; each message crosses once per engine step in each direction at most (a replica batches a step's
deltas), so a broker (ZeroMQ) would buy nothing here: one peer per pipe, no fan-out, and a pipe's EOF is
exactly the death notice the restart logic needs.

Startup: ready only when every replica has loaded, warmed up and replayed the golden prompts. A replica
that fails then fails the whole startup: a bad placement, core group or artifact does not heal by
retrying, and a server that reports ready with fewer replicas than configured hides lost capacity from
its autoscaler. After startup a replica that dies is restarted with exponential backoff while the others
serve. Its requests that have not yet handed anything to their caller move to another ready replica;
the others end with `ReplicaLostError` (503: the client may resend). No other replica's request is
touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from app import metrics
from app.artifacts.loader import LocalArtifact
from app.device_metrics import replica_tag, runtime_tag
from app.engine.engine import check_limits
from app.engine.output import RequestStream
from app.engine.types import FinishReason, GenerationParams, RequestOutput
from app.errors import ConfigError, Inf2ServeError, InvalidRequestError, NotReadyError, ReplicaLostError
from app.replicas import worker
from app.replicas.router import Router, RoutingPolicy, request_work
from app.settings import ServerSettings

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
HEALTHY_S = 60.0  # a replica up this long before dying restarts at the first backoff again


@dataclass(slots=True)
class Routed:
    """A request as the front tracks it: enough to resend it elsewhere before it has produced anything."""

    request_id: str
    prompt: tuple[int, ...]
    params: GenerationParams
    stream: RequestStream
    replica: int
    generated: int = 0
    delivered: bool = False  # a delta went to the caller: it can no longer move


class Replica:
    """One replica process and the requests routed to it. Touched on the front's event loop only,
    except `send` (any thread: a dropped stream aborts from the garbage collector)."""

    def __init__(self, index: int, device: str) -> None:
        self.index = index
        self.label = str(index)
        self.device = device
        self.process: BaseProcess | None = None
        self.conn: Connection | None = None
        self.incarnation = 0
        self.ready = False
        self.started_at = 0.0
        self.backoff_s = FIRST_BACKOFF_S
        self.requests: dict[str, Routed] = {}
        self.outstanding = 0
        self.started: asyncio.Future[str | None] | None = None  # the startup's outcome: None or why not
        self._send_lock = threading.Lock()

    @property
    def is_ready(self) -> bool:
        return self.ready

    def send(self, message: tuple[object, ...]) -> bool:
        conn = self.conn
        if conn is None:
            return False
        try:
            with self._send_lock:
                conn.send(message)
        except (OSError, ValueError):  # dead or closed: the reader reports the exit
            return False
        return True


class ReplicaPool:
    def __init__(
        self,
        artifact: LocalArtifact,
        settings: ServerSettings,
        devices: Sequence[str],
        policy: RoutingPolicy = "least_work",
    ) -> None:
        self.artifact = artifact
        self.settings = settings
        self.replicas = [Replica(index, device) for index, device in enumerate(devices)]
        self.router = Router(policy)
        self.eos_token_ids: frozenset[int] = frozenset()
        self.vocab_size = 0
        self.grid = artifact.manifest.spec.grid
        self.restarts = 0
        self._routed: dict[str, Routed] = {}
        self._context = get_context("spawn")  # fork is unsafe after threads (tokenizers, torch) exist
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serving = False  # every replica started once: from now on a dead one is restarted
        self._closing = False
        self._server_tag = runtime_tag()
        self.runtime_tags = {self._runtime_tag(r): r.label for r in self.replicas}

    # --- lifecycle ---

    async def start(self) -> None:
        """Start every replica; return once all are ready, or raise why one is not (stopping the rest)."""
        self._loop = asyncio.get_running_loop()
        for replica in self.replicas:
            self._spawn(replica)
        outcomes = await asyncio.gather(*(_started(r) for r in self.replicas))
        failures = [
            f"replica {r.index} ({r.device}): {why}"
            for r, why in zip(self.replicas, outcomes, strict=True)
            if why
        ]
        if failures:
            await asyncio.to_thread(self.close)
            raise ConfigError("replica startup failed: " + "; ".join(failures))
        self._serving = True

    def close(self) -> None:
        """Stop every replica (any thread). Each finishes what it still runs with a final delta first."""
        self._closing = True
        for replica in self.replicas:
            replica.send(("stop",))
        for replica in self.replicas:
            process = replica.process
            if process is not None:
                process.join(worker.STOP_TIMEOUT_S + 5.0)
                if process.is_alive():
                    log.error("replica did not stop: killing it", extra={"replica": replica.index})
                    process.kill()
                    process.join()

    @property
    def is_alive(self) -> bool:
        return not self._closing

    @property
    def num_unfinished(self) -> int:
        return len(self._routed)

    # --- EngineClient ---

    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: GenerationParams
    ) -> RequestStream:
        loop = asyncio.get_running_loop()
        if self._closing:
            raise NotReadyError("the server is shutting down")
        if request_id in self._routed:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        index = self.router.pick(self.replicas)
        if index is None:
            raise NotReadyError("no replica is ready")
        stream = RequestStream(request_id, loop, self.abort)
        routed = Routed(request_id, tuple(prompt_token_ids), params, stream, index)
        self._routed[request_id] = routed
        self._assign(routed, self.replicas[index])
        return stream

    def check_request(self, prompt_token_ids: Sequence[int], params: GenerationParams) -> None:
        """The limits the front can check; the sampling a backend lacks is refused by the replica (the
        request's one delta then carries the InvalidRequestError, before any token)."""
        check_limits(prompt_token_ids, params, self.vocab_size, self.grid)

    def abort(self, request_id: str) -> None:
        routed = self._routed.get(request_id)
        if routed is not None:
            self.replicas[routed.replica].send(("abort", request_id))

    def reset_prefix_cache(self) -> None:
        for replica in self.replicas:
            replica.send(("reset_prefix_cache",))

    # --- routing bookkeeping (event loop) ---

    def _assign(self, routed: Routed, replica: Replica) -> None:
        routed.replica = replica.index
        replica.requests[routed.request_id] = routed
        replica.outstanding += request_work(len(routed.prompt), routed.params.max_tokens, 0)
        replica.send(("generate", routed.request_id, routed.prompt, routed.params))

    def _on_outputs(self, replica: Replica, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            routed = replica.requests.get(output.request_id)
            if routed is None:
                continue
            before = request_work(len(routed.prompt), routed.params.max_tokens, routed.generated)
            routed.generated = output.num_generated_tokens
            routed.delivered = True
            if output.finished:
                replica.outstanding -= before
                del replica.requests[output.request_id]
                self._routed.pop(output.request_id, None)
            else:
                replica.outstanding -= before - request_work(
                    len(routed.prompt), routed.params.max_tokens, routed.generated
                )
            routed.stream.put(output)

    # --- processes ---

    def _spawn(self, replica: Replica) -> None:
        assert self._loop is not None
        replica.incarnation += 1
        replica.started = self._loop.create_future()
        ours, theirs = self._context.Pipe(duplex=True)
        settings = self.settings.model_copy(update={"device": replica.device})
        process = self._context.Process(
            target=worker.run_replica,
            args=(theirs, replica.index, self.artifact, settings, self._runtime_tag(replica)),
            name=f"inf2serve-replica-{replica.index}",
            daemon=True,
        )
        process.start()
        theirs.close()
        replica.process, replica.conn = process, ours
        log.info(
            "replica starting", extra={"replica": replica.index, "device": replica.device, "pid": process.pid}
        )
        reader = threading.Thread(
            target=self._read,
            args=(replica, ours, replica.incarnation),
            name=f"inf2serve-replica-{replica.index}",
            daemon=True,
        )
        reader.start()

    def _runtime_tag(self, replica: Replica) -> str:
        return replica_tag(self._server_tag, replica.index)

    def _read(self, replica: Replica, conn: Connection, incarnation: int) -> None:
        """A reader thread: hands each message to the event loop, then the pipe's end."""
        loop = self._loop
        assert loop is not None
        try:
            while True:
                loop.call_soon_threadsafe(self._on_message, replica, incarnation, conn.recv())
        except (EOFError, OSError):
            pass
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone
            loop.call_soon_threadsafe(self._on_exit, replica, incarnation)

    def _on_message(self, replica: Replica, incarnation: int, message: tuple[object, ...]) -> None:
        if incarnation != replica.incarnation:
            return
        kind = message[0]
        if kind == "outputs":
            self._on_outputs(replica, message[1])  # type: ignore[arg-type]
        elif kind == "stats":
            metrics.record_step_stats(message[1], replica.label)  # type: ignore[arg-type]
        elif kind == "ready":
            self.eos_token_ids = frozenset(message[1])  # type: ignore[arg-type]
            self.vocab_size = int(message[2])  # type: ignore[call-overload]
            replica.ready, replica.started_at = True, time.monotonic()
            log.info("replica ready", extra={"replica": replica.index, "device": replica.device})
            _resolve(replica.started, None)
        elif kind == "failed":
            log.error("replica failed to start", extra={"replica": replica.index, "error": message[1]})
            _resolve(replica.started, str(message[1]))

    def _on_exit(self, replica: Replica, incarnation: int) -> None:
        if incarnation != replica.incarnation:
            return
        replica.ready = False
        replica.conn = None
        metrics.forget_replica(replica.label)
        _resolve(replica.started, "the process exited during startup")
        if self._closing or not self._serving:
            self._fail_all(replica, NotReadyError("the server stopped before this request finished"))
            return
        exitcode = replica.process.exitcode if replica.process is not None else None
        log.error(
            "replica died: restarting it",
            extra={"replica": replica.index, "exitcode": exitcode, "backoff_s": replica.backoff_s},
        )
        self._rescue(replica)
        if replica.started_at and time.monotonic() - replica.started_at >= HEALTHY_S:
            replica.backoff_s = FIRST_BACKOFF_S
        delay, replica.backoff_s = replica.backoff_s, min(replica.backoff_s * 2, MAX_BACKOFF_S)
        replica.started_at = 0.0
        self.restarts += 1
        assert self._loop is not None
        self._loop.call_later(delay, self._restart, replica)

    def _restart(self, replica: Replica) -> None:
        if not self._closing:
            self._spawn(replica)

    def _rescue(self, replica: Replica) -> None:
        """Move the dead replica's requests that have handed out nothing; fail the others."""
        requests, replica.requests, replica.outstanding = list(replica.requests.values()), {}, 0
        for routed in requests:
            index = None if routed.delivered else self.router.pick(self.replicas)
            if index is None:
                self._fail(
                    routed,
                    ReplicaLostError(
                        f"replica {replica.index} stopped while generating this request; it may be sent again"
                    ),
                )
            else:
                log.info(
                    "request moved to another replica",
                    extra={"request_id": routed.request_id, "replica": index},
                )
                self._assign(routed, self.replicas[index])

    def _fail_all(self, replica: Replica, error: Inf2ServeError) -> None:
        requests, replica.requests, replica.outstanding = list(replica.requests.values()), {}, 0
        for routed in requests:
            self._fail(routed, error)

    def _fail(self, routed: Routed, error: Inf2ServeError) -> None:
        self._routed.pop(routed.request_id, None)
        routed.stream.put(
            RequestOutput(
                routed.request_id,
                (),
                "",
                (),
                len(routed.prompt),
                routed.generated,
                True,
                FinishReason.ERROR,
                error,
            )
        )


async def _started(replica: Replica) -> str | None:
    assert replica.started is not None
    return await replica.started


def _resolve(future: asyncio.Future[str | None] | None, outcome: str | None) -> None:
    if future is not None and not future.done():
        future.set_result(outcome)
