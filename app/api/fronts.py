"""Several front processes on one port (`--api-servers N`, as vLLM's `--api-server-count`): the front's
CPU per streamed token is then spent in N interpreters, not under one GIL.

The process `serve` started becomes a supervisor. It listens on the port and hands each connection it
accepts to one front process, over a Unix socket pair (the descriptor passed with SCM_RIGHTS), to the
front holding the fewest open connections it was handed (the front reports each close back): the fronts'
shares of the traffic stay even, connection by connection, as far as clients spread their requests over
connections. Front i is a whole server (app/api/server.py) over its share of the replicas: i, i+N,
i+2N, ... Each front answers the probes and `/metrics` for the whole server, by asking the others over
Unix sockets in a private directory (app/api/peers.py).

The supervisor forwards SIGTERM and SIGINT to every front, and each front drains as a lone server does;
the supervisor keeps accepting for the same drain window, then closes the port. The exit code is the
worst of the fronts' (3 over 1 over 0). A front that exits on its own, from a failed startup or a crash,
gets no more connections and makes the supervisor drain the others, and the server then exits non-zero,
as a lone front would. A front whose supervisor is gone (killed with SIGKILL) drains and exits: its pipe
from the supervisor reads EOF.

What stays per front: admission and routing see only the front's own replicas, so a connection is
served by one share.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from app.settings import ServerSettings

log = logging.getLogger(__name__)

DISPATCH_TICK_S = 0.25  # how late the dispatcher may notice that its accepting time is over


@dataclass(frozen=True, slots=True)
class ApiServer:
    """Which front process this is, of how many, and where the fronts' Unix sockets live."""

    index: int
    count: int
    directory: Path

    def socket_path(self, index: int) -> Path:
        return self.directory / f"front-{index}.sock"

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.count) if i != self.index)

    def share(self, devices: Sequence[str]) -> list[tuple[int, str]]:
        """This front's replicas: (number on the server, device placement)."""
        return [
            (number, device) for number, device in enumerate(devices) if number % self.count == self.index
        ]


ALONE = ApiServer(0, 1, Path())
"""The one front of a server without `--api-servers`: every replica is its own, and it has no peers."""

FrontMain = Callable[[ServerSettings, ApiServer, socket.socket, Connection], None]
"""A front process's entry point: its settings, who it is, its end of the connection hand-off, and its
pipe from the supervisor."""

HANDED = b"c"  # the byte that carries a handed-over connection's descriptor
CLOSED = b"x"  # a front's report that a connection it was handed has closed


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


class Dispatcher:
    """Accepts connections on the port and hands each to the front holding the fewest (a thread of the
    supervisor). Each front's end of its hand-off socket pair (SOCK_SEQPACKET: one message, one
    connection) receives the descriptors; the front writes CLOSED back when one closes."""

    def __init__(self, listener: socket.socket, channels: Sequence[socket.socket]) -> None:
        self.listener = listener
        self.channels = list(channels)
        self.open = [0] * len(channels)  # connections handed to each front and not yet closed
        self.gone: set[int] = set()  # fronts whose end of the hand-off is closed
        self.deadline: float | None = None  # when to stop accepting (time.monotonic())
        self._next = 0  # where ties start: the front after the last one handed a connection
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._run, name="inf2serve-dispatcher", daemon=True)

    def start(self) -> None:
        self.listener.setblocking(False)
        self._selector.register(self.listener, selectors.EVENT_READ)
        for front, channel in enumerate(self.channels):
            channel.setblocking(False)
            self._selector.register(channel, selectors.EVENT_READ, data=front)
        self._thread.start()

    def stop_after(self, seconds: float) -> None:
        """Stop accepting `seconds` from now (or sooner, if already due)."""
        deadline = time.monotonic() + seconds
        self.deadline = deadline if self.deadline is None else min(self.deadline, deadline)

    def _run(self) -> None:
        try:
            while self.deadline is None or time.monotonic() < self.deadline:
                for key, _ in self._selector.select(DISPATCH_TICK_S):
                    if key.fileobj is self.listener:
                        self._accept()
                    else:
                        self._count_closes(key.data)
        finally:
            self.listener.close()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        with conn:
            for front in self._in_order():
                try:
                    socket.send_fds(self.channels[front], [HANDED], [conn.fileno()])
                except BlockingIOError:  # that front is not reading its hand-offs: the next one
                    continue
                except OSError:
                    self._lose(front)
                    continue
                self.open[front] += 1
                self._next = front + 1
                return
        # no front took it: the connection closes

    def _in_order(self) -> list[int]:
        """The live fronts, fewest open connections first; ties from the one after the last handed one,
        so that clients that come one after another are spread too."""
        count = len(self.channels)
        return sorted(set(range(count)) - self.gone, key=lambda f: (self.open[f], (f - self._next) % count))

    def _count_closes(self, front: int) -> None:
        try:
            closed = self.channels[front].recv(4096)
        except BlockingIOError:
            return
        except OSError:
            closed = b""
        if closed:
            self.open[front] -= len(closed)
        else:
            self._lose(front)

    def _lose(self, front: int) -> None:
        if front not in self.gone:
            self.gone.add(front)
            self._selector.unregister(self.channels[front])


def watch_supervisor(conn: Connection) -> None:
    """In a front: drain (SIGTERM to itself) once the supervisor's end of `conn` closes."""

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            conn.recv()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="inf2serve-supervisor-watch", daemon=True).start()


def supervise(settings: ServerSettings, front_main: FrontMain) -> int:
    """Run `settings.api_servers` fronts until all have exited; the worst exit code of theirs."""
    count = settings.api_servers
    directory = Path(tempfile.mkdtemp(prefix="inf2serve-fronts-"))
    context = get_context("spawn")  # fork is unsafe once threads exist; spawn passes the sockets by fd
    fronts = Fronts(settings.drain_s)
    links: list[Connection] = []
    try:
        try:
            listener = listen(settings.host, settings.port)
        except OSError as error:  # as uvicorn says it for a lone front: one line, exit 1
            log.error(
                "cannot listen", extra={"host": settings.host, "port": settings.port, "error": str(error)}
            )
            return 1
        channels = []
        for index in range(count):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            their_link, our_link = context.Pipe(duplex=False)
            front = context.Process(
                target=front_main,
                args=(settings, ApiServer(index, count, directory), theirs, their_link),
                name=f"inf2serve-front-{index}",
            )
            front.start()
            theirs.close()
            their_link.close()
            fronts.processes.append(front)
            channels.append(ours)
            links.append(our_link)
        fronts.dispatcher = Dispatcher(listener, channels)
        fronts.dispatcher.start()
        log.info("front processes started", extra={"pids": [front.pid for front in fronts.processes]})
        signal.signal(signal.SIGTERM, fronts.forward)
        signal.signal(signal.SIGINT, fronts.forward)
        return fronts.wait()
    finally:
        for link in links:
            link.close()
        shutil.rmtree(directory, ignore_errors=True)


class Fronts:
    """The supervisor's front processes: signals go to each; the first to exit unasked drains the rest."""

    def __init__(self, drain_s: float) -> None:
        self.drain_s = drain_s
        self.processes: list[BaseProcess] = []
        self.dispatcher: Dispatcher | None = None
        self.stopping = False  # a signal came, or a front exited: the others were told

    def forward(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler for SIGTERM and SIGINT: each front drains (or stops) as a lone server does,
        and the port stays open as long as they accept."""
        first_term = sig == signal.SIGTERM and not self.stopping
        self.stopping = True
        if self.dispatcher is not None:
            self.dispatcher.stop_after(self.drain_s if first_term else 0.0)
        self._signal(self.processes, sig)

    def wait(self) -> int:
        running = list(self.processes)
        while running:
            for sentinel in wait([front.sentinel for front in running]):
                front = next(f for f in running if f.sentinel == sentinel)
                front.join()
                running.remove(front)
                if running and not self.stopping:
                    log.error(
                        "a front process exited: draining the others",
                        extra={"front": front.name, "exitcode": front.exitcode},
                    )
                    self.stopping = True
                    if self.dispatcher is not None:
                        self.dispatcher.stop_after(self.drain_s)
                    self._signal(running, signal.SIGTERM)
        return worst_exit_code([front.exitcode for front in self.processes])

    @staticmethod
    def _signal(fronts: Sequence[BaseProcess], sig: int) -> None:
        for front in fronts:
            if front.pid is not None and front.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(front.pid, sig)


def worst_exit_code(codes: Sequence[int | None]) -> int:
    """3 (a stream was cut) over 1 (failed, or killed by a signal) over 0."""
    ranks = [code if code in (0, 3) else 1 for code in codes]
    return 3 if 3 in ranks else max(ranks, default=0)
