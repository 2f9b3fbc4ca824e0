"""The front's sending end of a replica's pipe: a writer thread behind a bounded queue, so that the event
loop never blocks on a replica that stopped reading (SIGSTOP, a wedged process: its pipe fills up and a
plain `send` would block the whole front). A full queue says the replica is not keeping up; the caller
treats it as hung.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from multiprocessing.connection import Connection

from app.replicas.messages import ToReplica

MAX_QUEUED = 4096  # messages; a replica that reads nothing for this many is hung, not slow


class PipeWriter:
    def __init__(self, conn: Connection, name: str) -> None:
        self._conn = conn
        self._queue: queue.Queue[ToReplica | None] = queue.Queue(MAX_QUEUED)
        self._thread = threading.Thread(target=self._write, name=name, daemon=True)
        self._thread.start()

    def send(self, message: ToReplica) -> bool:
        """Queue a message (any thread, never blocks); False when the replica is not keeping up or gone."""
        try:
            self._queue.put_nowait(message)
        except queue.Full:
            return False
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the writer once what is queued is written (or at once, if the queue is full)."""
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)

    def _write(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the replica is gone: its reader reports the exit
                return
