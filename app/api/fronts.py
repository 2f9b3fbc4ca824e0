"""Several front processes on one port (`--api-servers N`, as vLLM's `--api-server-count`): the front's
CPU per streamed token is then spent in N interpreters, not under one GIL.

The process `serve` started becomes a supervisor. It opens N listening sockets on the port with
`SO_REUSEPORT`, so that the kernel spreads new connections evenly over them, and starts one front process
per socket. Front i is a whole server (app/api/server.py) over its share of the replicas: i, i+N, i+2N, ...
Each front answers the probes and `/metrics` for the whole server, by asking the others over Unix sockets
in a private directory (app/api/peers.py).

The supervisor forwards SIGTERM and SIGINT to every front, and each front drains as a lone server does.
The exit code is the worst of theirs (3 over 1 over 0). A front that exits on its own, from a failed
startup or a crash, makes the supervisor drain the others, and the server then exits non-zero, as a lone
front would. A front whose supervisor is gone (killed with SIGKILL) drains and exits: its pipe from the
supervisor reads EOF.

What stays per front: admission and routing see only the front's own replicas, so a client's connection
is served by one share. With connections spread evenly, the shares fill evenly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from app.settings import ServerSettings

log = logging.getLogger(__name__)


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


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets listening on one port (the first one's, where `port` is 0), `SO_REUSEPORT`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            sock.listen(2048)
            sock.set_inheritable(True)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


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
    fronts = Fronts()
    links: list[Connection] = []
    try:
        sockets = listening_sockets(settings.host, settings.port, count)
        for index, sock in enumerate(sockets):
            theirs, ours = context.Pipe(duplex=False)
            front = context.Process(
                target=front_main,
                args=(settings, ApiServer(index, count, directory), sock, theirs),
                name=f"inf2serve-front-{index}",
            )
            front.start()
            theirs.close()
            sock.close()
            fronts.processes.append(front)
            links.append(ours)
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

    def __init__(self) -> None:
        self.processes: list[BaseProcess] = []
        self.stopping = False  # a signal came, or a front exited: the others were told

    def forward(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler for SIGTERM and SIGINT: each front drains (or stops) as a lone server does."""
        self.stopping = True
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
