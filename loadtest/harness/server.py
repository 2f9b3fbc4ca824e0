"""A real server process on loopback for tests and benchmarks: started from the console scripts with a
given environment, its JSON log captured to a file, stopped with SIGTERM, every wait bounded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

BIN = Path(sys.executable).parent
START_TIMEOUT_S = 120.0


def metric_sums(
    text: str, sample: str, label: str, missing: str | None = None, **where: str
) -> dict[str, float]:
    """From a /metrics text: the values of `sample` whose labels match `where`, summed by `label` (a
    sample without it counts as `missing`, or is skipped)."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            key = found.labels.get(label, missing)
            if (
                found.name == sample
                and key is not None
                and all(found.labels.get(k) == v for k, v in where.items())
            ):
                sums[key] = sums.get(key, 0.0) + found.value
    return sums


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(self, argv: list[str], env: dict[str, str], port: int, log_path: Path) -> None:
        self.argv = argv
        self.env = {**os.environ, **env}
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProcess:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None and self.process.poll() is None, self.failure("exited")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(self.failure(f"not ready after {timeout_s} s"))

    def failure(self, what: str) -> str:
        return f"server {what}; its log:\n{self.log_path.read_text()[-4000:]}"

    def terminate(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float = 60.0) -> int:
        assert self.process is not None
        return self.process.wait(timeout_s)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.terminate()
            try:
                self.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def wait_for_log(
        self, matches: Callable[[dict[str, object]], bool], timeout_s: float = 30.0
    ) -> list[dict[str, object]]:
        """The log lines that match, once there is one: a request's access line is written after its
        response is sent, so it may trail the client's read."""
        deadline = time.monotonic() + timeout_s
        while not (found := [line for line in self.log_lines() if matches(line)]):
            assert time.monotonic() < deadline, self.failure(f"logged no such line in {timeout_s} s")
            time.sleep(0.05)
        return found

    def log_lines(self) -> list[dict[str, object]]:
        lines = []
        for line in self.log_path.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                lines.append({"unparsed": line})
        return lines
