"""The front's side of the replicas: `ReplicaPool` starts one process per placement (app/replicas/worker.py),
routes each request to one (app/replicas/router.py), relays its deltas, records every replica's
`StepStats` under its `replica` label, restarts a replica that dies or hangs, and stops them all on
shutdown. It is an `EngineClient` (app/engine/types.py) as a single `LLMEngine` is, whole: admission
across the replicas, readiness, the drain's expected time, the request deadline.

IPC: one `multiprocessing` duplex pipe per replica, typed messages (app/replicas/messages.py). The front
reads each pipe on a reader thread and writes it through a writer thread behind a bounded queue
(app/replicas/pipe.py), so the event loop never blocks on a replica. A broker (ZeroMQ) would buy nothing:
one peer per pipe, no fan-out, and a pipe's EOF is exactly the death notice the restart logic needs.

Health: a replica is ready while its heartbeats (every HEARTBEAT_S) keep coming and say its engine is
ready. One that sends none for HUNG_AFTER_S (stopped, wedged) or says not ready that long (its engine
stalled with work pending) is hung: the front kills it, and from then on it is a dead replica. A replica
whose engine loop dies ends its own process. A dead replica's requests that have handed nothing to their
caller move to another ready replica; the others end with `ReplicaLostError` (503: the client may resend).
No other replica's request is touched. It is restarted with exponential backoff.

Admission: the front knows exactly what each replica holds (every request it sent and every delta back),
and each replica's heartbeat brings its measured rates; `backlog()` combines them
(`app.engine.admission.Backlog`), so a request the pool as a whole cannot take in time is refused with
429 + Retry-After before it is routed, and one a replica refuses (it raced) moves to another with room.

Startup: ready only when every replica has loaded, warmed up and replayed the golden prompts. A replica
that fails then fails the whole startup: a bad placement, core group or artifact does not heal by
retrying, and a server that reports ready with fewer replicas than configured hides lost capacity from
its autoscaler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing import get_context
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from app import metrics
from app.artifacts.loader import LocalArtifact
from app.backends.base import check_sampling
from app.device_metrics import replica_tag, runtime_tag
from app.engine.admission import Backlog, Refusals
from app.engine.engine import check_limits
from app.engine.output import RequestStream
from app.engine.types import GenerationParams, RequestOutput, final_error
from app.errors import (
    ConfigError,
    DeadlineExceededError,
    Inf2ServeError,
    InvalidRequestError,
    NotReadyError,
    OverloadedError,
    ReplicaLostError,
)
from app.replicas import worker
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
    Stop,
    ToReplica,
)
from app.replicas.pipe import PipeWriter
from app.replicas.router import Router, RoutingPolicy, request_work
from app.settings import ServerSettings

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
HEALTHY_S = 60.0  # a replica up this long before dying restarts at the first backoff again
HUNG_AFTER_S = 5.0  # no heartbeat, or heartbeats saying not ready, this long: the replica is hung
# For all the replicas together to stop, then they are killed: within the server's grace after the
# shutdown cut (app/api/server.py CUT_GRACE_S), so that with the default drain (10 s) and shutdown timeout
# (15 s) the process is gone before SageMaker's SIGKILL at 30 s, a hung replica included.
CLOSE_TIMEOUT_S = 3.0


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
    tried: set[int] = field(default_factory=set)  # replicas that refused it (queue full)
    expiry: asyncio.TimerHandle | None = None  # the deadline, enforced here wherever the request is


class Replica:
    """One replica process and the requests routed to it. Touched on the front's event loop only,
    except `send` (any thread: a dropped stream aborts from the garbage collector)."""

    def __init__(self, index: int, number: int, device: str, num_slots: int) -> None:
        self.index = index  # in this pool
        self.number = number  # on the server: replicas are numbered across the front processes
        self.label = str(number)
        self.device = device
        self.num_slots = num_slots
        self.process: BaseProcess | None = None
        self.pipe: PipeWriter | None = None
        self.incarnation = 0
        self.ready = False  # started: loaded, warmed up, checked
        self.engine_ready = False  # as its last heartbeat said
        self.last_heartbeat = 0.0
        self.fine_since = 0.0  # when its heartbeats last said ready (time.monotonic())
        self.fill = 1.0
        self.token_s = 0.0
        self.prefill_s = 0.0
        self.started_at = 0.0
        self.backoff_s = FIRST_BACKOFF_S
        self.requests: dict[str, Routed] = {}
        self.started: asyncio.Future[str | None] | None = None  # the startup's outcome: None or why not

    @property
    def is_ready(self) -> bool:
        return self.ready and self.engine_ready

    @property
    def outstanding(self) -> int:
        """Its requests' outstanding work in tokens (app/replicas/router.py), from the front's own books."""
        return sum(
            request_work(len(r.prompt), r.params.max_tokens, r.generated) for r in self.requests.values()
        )

    def send(self, message: ToReplica) -> bool:
        pipe = self.pipe
        return pipe is not None and pipe.send(message)

    def is_hung(self, now: float) -> bool:
        """Started, and silent or not ready for HUNG_AFTER_S."""
        return self.ready and now - min(self.last_heartbeat, self.fine_since) > HUNG_AFTER_S

    def backlog(self) -> Backlog:
        """What it holds, from the front's own books, at the rates its heartbeats report."""
        held = len(self.requests)
        work = sum(r.params.max_tokens - r.generated for r in self.requests.values())
        free = max(0, self.num_slots - held)
        waiting = max(0, held - self.num_slots)
        return Backlog(self.num_slots, free, waiting, work, self.fill, self.token_s, self.prefill_s)


class ReplicaPool:
    def __init__(
        self,
        artifact: LocalArtifact,
        settings: ServerSettings,
        devices: Sequence[str],
        policy: RoutingPolicy = "least_work",
        numbers: Sequence[int] | None = None,
    ) -> None:
        """`numbers`: each replica's number on the server (metrics labels, logs, process names); by
        default 0, 1, ... (one front process: its pool is all the replicas)."""
        self.artifact = artifact
        self.settings = settings
        self.config = settings.engine_config()
        self.grid = artifact.manifest.spec.grid
        numbers = range(len(devices)) if numbers is None else numbers
        self.replicas = [
            Replica(index, number, device, self.grid.num_slots)
            for index, (number, device) in enumerate(zip(numbers, devices, strict=True))
        ]
        self.router = Router(policy)
        self.eos_token_ids: frozenset[int] = frozenset()
        self.vocab_size = 0
        self.backend_name = ""
        self.sampling_features: frozenset[str] = frozenset()
        self.restarts = 0
        self._routed: dict[str, Routed] = {}
        self._refusals = Refusals(time.monotonic)  # Retry-After across a burst
        self._context = get_context("spawn")  # fork is unsafe after threads (tokenizers, torch) exist
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task[None] | None = None
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
            f"replica {r.number} ({r.device}): {why}"
            for r, why in zip(self.replicas, outcomes, strict=True)
            if why
        ]
        if failures:
            await asyncio.to_thread(self.close)
            raise ConfigError("replica startup failed: " + "; ".join(failures))
        self._serving = True
        self._watchdog = asyncio.create_task(self._watch())

    def close(self) -> None:
        """Stop every replica (any thread, blocking; at most CLOSE_TIMEOUT_S plus a kill). Every unfinished
        request ends at once with NotReadyError, on the front: a hung replica would never say so."""
        self._closing = True
        self._on_loop(self._end_all)
        for replica in self.replicas:
            replica.send(Stop())
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for replica in self.replicas:
            process = replica.process
            if process is None:
                continue
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.error("replica did not stop: killing it", extra={"replica": replica.number})
                process.kill()
                process.join()

    # --- EngineClient ---

    @property
    def is_alive(self) -> bool:
        """The pool can still serve: not closed (a dead or hung replica is restarted)."""
        return not self._closing

    @property
    def is_ready(self) -> bool:
        """Some replica is ready to take a request."""
        return not self._closing and any(r.is_ready for r in self.replicas)

    @property
    def num_unfinished(self) -> int:
        return len(self._routed)

    def backlog(self) -> Backlog:
        """The ready replicas' work as one engine's (`Backlog.pooled`)."""
        ready = [r.backlog() for r in self.replicas if r.is_ready]
        return Backlog.pooled(ready) if ready else Backlog(0, 0, 0, 0, 1.0, 0.0)

    def expected_time_s(self, max_tokens: int) -> float | None:
        backlog = self.backlog()
        return backlog.expected_time_s(max_tokens) if backlog.measured else None

    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: GenerationParams
    ) -> RequestStream:
        loop = asyncio.get_running_loop()
        if self._closing:
            raise NotReadyError("the server is shutting down")
        if request_id in self._routed:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_token_ids, params)
        ready = sum(r.is_ready for r in self.replicas)
        if not ready:
            raise NotReadyError("no replica is ready")
        self.backlog().check(
            self.config.max_waiting * ready, self.config.max_queue_wait_s, self._refusals, params.max_tokens
        )
        params = self._with_deadline(params)
        stream = RequestStream(request_id, loop, self.abort, params.read_at_end)
        routed = Routed(request_id, tuple(prompt_token_ids), params, stream, -1)
        self._routed[request_id] = routed
        if params.deadline is not None:
            routed.expiry = loop.call_later(params.deadline - time.monotonic(), self._expire, routed)
        if not self._route(routed):
            self._forget(routed)
            raise NotReadyError("no replica is ready")
        return stream

    def check_request(self, prompt_token_ids: Sequence[int], params: GenerationParams) -> None:
        """The replicas' backend's checks, from what they reported when ready (`Ready`)."""
        check_sampling(params.sampling, self.vocab_size, self.sampling_features, self.backend_name)
        check_limits(prompt_token_ids, params, self.vocab_size, self.grid)

    def abort(self, request_id: str) -> None:
        routed = self._routed.get(request_id)
        if routed is not None and routed.replica >= 0:
            self.replicas[routed.replica].send(Abort(request_id))

    def reset_prefix_cache(self) -> None:
        for replica in self.replicas:
            replica.send(ResetPrefixCache())

    # --- routing bookkeeping (event loop) ---

    def _with_deadline(self, params: GenerationParams) -> GenerationParams:
        timeout_s = self.config.request_timeout_s
        if params.deadline is not None or timeout_s is None:
            return params
        return replace(params, deadline=time.monotonic() + timeout_s)  # the replica's engine keeps it too

    def _route(self, routed: Routed) -> bool:
        """Send the request to the ready replica with the least work (never one that refused it); False
        when none takes it."""
        while True:
            candidates = [r for r in self.replicas if r.index not in routed.tried]
            index = self.router.pick(candidates)
            if index is None:
                return False
            replica = candidates[index]
            if self._assign(routed, replica):
                return True
            routed.tried.add(replica.index)
            self._hung(replica, "its pipe is full")

    def _assign(self, routed: Routed, replica: Replica) -> bool:
        routed.replica = replica.index
        replica.requests[routed.request_id] = routed
        if replica.send(Generate(routed.request_id, routed.prompt, routed.params)):
            return True
        del replica.requests[routed.request_id]
        return False

    def _on_outputs(self, replica: Replica, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            routed = replica.requests.get(output.request_id)
            if routed is None:
                continue
            if output.finished:
                del replica.requests[output.request_id]
                if isinstance(output.error, OverloadedError) and self._reroute(routed, replica):
                    continue
                self._forget(routed)
            else:
                routed.generated = output.num_generated_tokens
            routed.delivered = True
            routed.stream.put(output)

    def _reroute(self, routed: Routed, refused_by: Replica) -> bool:
        """A request its replica refused (its queue was full when it arrived) goes to another with room."""
        if routed.delivered:
            return False
        routed.tried.add(refused_by.index)
        return self._route(routed)

    def _expire(self, routed: Routed) -> None:
        """The request's deadline passed wherever it is (queued, running, on a hung replica)."""
        if self._routed.get(routed.request_id) is not routed:
            return
        self.abort(routed.request_id)
        replica = self.replicas[routed.replica]
        replica.requests.pop(routed.request_id, None)
        self._fail(routed, DeadlineExceededError("the request's deadline (request_timeout_s) passed"))

    def _forget(self, routed: Routed) -> None:
        self._routed.pop(routed.request_id, None)
        if routed.expiry is not None:
            routed.expiry.cancel()

    # --- processes ---

    def _spawn(self, replica: Replica) -> None:
        assert self._loop is not None
        replica.incarnation += 1
        replica.started = self._loop.create_future()
        ours, theirs = self._context.Pipe(duplex=True)
        # The front admits for the pool; a replica's own queue bound holds all that the front may send it
        # (its slots and the pool's queue), so that it never refuses for queue length what the front
        # admitted: its engine counts a request as waiting until its next step takes it into a slot.
        held = self.grid.num_slots + self.config.max_waiting * len(self.replicas)
        settings = self.settings.model_copy(update={"device": replica.device, "max_waiting": held})
        process = self._context.Process(
            target=worker.run_replica,
            args=(theirs, replica.number, self.artifact, settings, self._runtime_tag(replica)),
            name=f"inf2serve-replica-{replica.number}",
            daemon=True,
        )
        process.start()
        theirs.close()
        replica.process = process
        replica.pipe = PipeWriter(ours, f"inf2serve-replica-{replica.number}-writer")
        log.info(
            "replica starting",
            extra={"replica": replica.number, "device": replica.device, "pid": process.pid},
        )
        reader = threading.Thread(
            target=self._read,
            args=(replica, ours, replica.incarnation),
            name=f"inf2serve-replica-{replica.number}-reader",
            daemon=True,
        )
        reader.start()

    def _runtime_tag(self, replica: Replica) -> str:
        return replica_tag(self._server_tag, replica.number)

    def _read(self, replica: Replica, conn: Connection, incarnation: int) -> None:
        """A reader thread: hands each message to the event loop, then the pipe's end."""
        loop = self._loop
        assert loop is not None
        try:
            while True:
                loop.call_soon_threadsafe(self._on_message, replica, incarnation, conn.recv())
        except (EOFError, OSError):
            pass
        except RuntimeError:  # the loop is closed: the server is gone
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._on_exit, replica, incarnation)

    def _on_message(self, replica: Replica, incarnation: int, message: FromReplica) -> None:
        if incarnation != replica.incarnation:
            return
        match message:
            case Outputs(outputs):
                self._on_outputs(replica, outputs)
            case Stats(stats, fill, token_s, prefill_s):
                metrics.record_step_stats(stats, replica.label)
                replica.fill, replica.token_s, replica.prefill_s = fill, token_s, prefill_s
            case Heartbeat(ready, fill, token_s, prefill_s):
                now = time.monotonic()
                replica.last_heartbeat, replica.engine_ready = now, ready
                replica.fill, replica.token_s, replica.prefill_s = fill, token_s, prefill_s
                if ready:
                    replica.fine_since = now
            case Ready(eos_token_ids, vocab_size, backend_name, sampling_features, fill, token_s, prefill_s):
                self.eos_token_ids, self.vocab_size = frozenset(eos_token_ids), vocab_size
                self.backend_name, self.sampling_features = backend_name, sampling_features
                replica.fill, replica.token_s, replica.prefill_s = fill, token_s, prefill_s
                now = time.monotonic()
                replica.ready = replica.engine_ready = True
                replica.started_at = replica.last_heartbeat = replica.fine_since = now
                log.info("replica ready", extra={"replica": replica.number, "device": replica.device})
                _resolve(replica.started, None)
            case Failed(why):
                log.error("replica failed to start", extra={"replica": replica.number, "error": why})
                _resolve(replica.started, why)

    async def _watch(self) -> None:
        """Every HEARTBEAT_S: a replica silent or not ready for HUNG_AFTER_S is hung."""
        while not self._closing:
            await asyncio.sleep(HEARTBEAT_S)
            now = time.monotonic()
            for replica in self.replicas:
                if replica.is_hung(now):
                    self._hung(replica, "no heartbeat, or not ready, for HUNG_AFTER_S")

    def _hung(self, replica: Replica, why: str) -> None:
        """Treat it as dead: kill it (its reader then sees the pipe close: `_on_exit`)."""
        if not replica.ready:
            return
        log.error("replica hung: killing it", extra={"replica": replica.number, "why": why})
        replica.ready = replica.engine_ready = False
        if replica.process is not None:
            replica.process.kill()

    def _on_exit(self, replica: Replica, incarnation: int) -> None:
        if incarnation != replica.incarnation:
            return
        replica.ready = replica.engine_ready = False
        if replica.pipe is not None:
            replica.pipe.close()
        replica.pipe = None
        metrics.forget_replica(replica.label)
        _resolve(replica.started, "the process exited during startup")
        if self._closing or not self._serving:
            self._fail_all(replica, NotReadyError("the server stopped before this request finished"))
            return
        exitcode = replica.process.exitcode if replica.process is not None else None
        log.error(
            "replica died: restarting it",
            extra={"replica": replica.number, "exitcode": exitcode, "backoff_s": replica.backoff_s},
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
        requests, replica.requests = list(replica.requests.values()), {}
        for routed in requests:
            if not routed.delivered and self._route(routed):
                log.info(
                    "request moved to another replica",
                    extra={"request_id": routed.request_id, "replica": routed.replica},
                )
                continue
            lost = f"replica {replica.number} stopped while generating this request; it may be sent again"
            self._fail(routed, ReplicaLostError(lost))

    def _end_all(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for replica in self.replicas:
            self._fail_all(replica, NotReadyError("the server stopped before this request finished"))

    def _fail_all(self, replica: Replica, error: Inf2ServeError) -> None:
        requests, replica.requests = list(replica.requests.values()), {}
        for routed in requests:
            self._fail(routed, error)

    def _fail(self, routed: Routed, error: Inf2ServeError) -> None:
        self._forget(routed)
        routed.stream.put(final_error(routed.request_id, len(routed.prompt), routed.generated, error))

    def _on_loop(self, callback: Callable[[], None]) -> None:
        """Run `callback` on the event loop and wait for it (from another thread), or run it here."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            callback()
            return
        done = threading.Event()

        def run() -> None:
            try:
                callback()
            finally:
                done.set()

        with contextlib.suppress(RuntimeError):  # closed meanwhile
            loop.call_soon_threadsafe(run)
            done.wait(CLOSE_TIMEOUT_S)


async def _started(replica: Replica) -> str | None:
    assert replica.started is not None
    return await replica.started


def _resolve(future: asyncio.Future[str | None] | None, outcome: str | None) -> None:
    if future is not None and not future.done():
        future.set_result(outcome)
