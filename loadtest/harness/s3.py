"""A real S3 protocol server on loopback for tests: moto's server mode, started as its own process
(`python -m moto.server`), never an in-process patch of boto3. Also a fault-injecting HTTP proxy that
sits between boto3 and that server, to exercise retries against real transient failures.

The tests' pytest fixtures over it live in tests/s3_server.py. For a child process, pass
`s3_env(endpoint_url)`.
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from loadtest.harness.server import free_port

REGION = "us-east-1"
DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


@dataclass
class S3Server:
    """A moto server process; `endpoint_url` is its loopback address."""

    endpoint_url: str
    process: subprocess.Popen[bytes]

    def client(self, **credentials: str) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id=credentials.get("key", DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"]),
            aws_secret_access_key=credentials.get("secret", DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]),
        )

    def iam(self) -> Any:
        import boto3

        return boto3.client(
            "iam",
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def enforce_auth(self, enabled: bool) -> None:
        """Switch moto's IAM authorization on (every request checked from now on) or off."""
        count = b"0" if enabled else b"inf"
        url, headers = f"{self.endpoint_url}/moto-api/reset-auth", {"Content-Type": "text/plain"}
        request = urllib.request.Request(url, data=count, method="POST", headers=headers)
        urllib.request.urlopen(request, timeout=10).read()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def start_s3_server(timeout_s: float = 30.0, env: dict[str, str] | None = None) -> S3Server:
    """Start `python -m moto.server` on a free loopback port; `env` adds moto settings (e.g.
    MOTO_S3_DEFAULT_KEY_BUFFER_SIZE)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **DUMMY_CREDENTIALS, **(env or {})},
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto server exited with status {process.returncode}")
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).read()
            return S3Server(endpoint, process)
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"moto server did not answer on {endpoint} within {timeout_s}s")


def s3_env(endpoint_url: str, max_attempts: int = 3) -> dict[str, str]:
    """The standard AWS environment that points boto3 (and so the loader) at `endpoint_url`."""
    return {
        "AWS_ENDPOINT_URL_S3": endpoint_url,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_MAX_ATTEMPTS": str(max_attempts),
        "AWS_EC2_METADATA_DISABLED": "true",
        **DUMMY_CREDENTIALS,
    }


def use_endpoint(monkeypatch: Any, endpoint_url: str, max_attempts: int = 3) -> None:
    """Point this process's S3 client at `endpoint_url` (a fresh client, from the environment)."""
    from app.artifacts.storage import s3_client

    for name, value in s3_env(endpoint_url, max_attempts).items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    s3_client.cache_clear()


def upload_tree(client: Any, local_dir: Path, bucket: str, prefix: str) -> None:
    for path in sorted(local_dir.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local_dir).as_posix()}")


@dataclass(frozen=True)
class ProxiedRequest:
    """What the proxy saw of one request: its method and path, and its Range and If-Match headers."""

    method: str
    path: str
    range: str | None
    if_match: str | None


SLOW_FIRST_BYTE_S = 0.3


@dataclass
class FaultProxy:
    """An HTTP proxy to `upstream` that records every request (`requests`); each GET of an object takes
    the next fault from `faults` (when any): "503" answers 503 SlowDown, "truncate" sends the headers and
    half the body, then closes, "slow" answers after SLOW_FIRST_BYTE_S, as a distant server would (any
    other name serves the request as is, counted)."""

    upstream: str
    faults: list[str] = field(default_factory=list)
    served_faults: list[str] = field(default_factory=list)
    requests: list[ProxiedRequest] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def endpoint_url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def next_fault(self, method: str, path: str, headers: Any) -> str | None:
        self.requests.append(ProxiedRequest(method, path, headers.get("Range"), headers.get("If-Match")))
        is_object = len(PurePosixPath(urlsplit(path).path).parts) > 2  # "/", bucket, key...
        if method == "GET" and is_object and self.faults:
            fault = self.faults.pop(0)
            self.served_faults.append(fault)
            return fault
        return None


@contextmanager
def fault_proxy(upstream: str, faults: list[str]) -> Iterator[FaultProxy]:
    proxy = FaultProxy(upstream, list(faults))
    host, port = upstream.removeprefix("http://").split(":")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def relay(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
            fault = proxy.next_fault(self.command, self.path, self.headers)
            if fault == "slow":
                time.sleep(SLOW_FIRST_BYTE_S)
            if fault == "503":
                error = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
                self.send_response(503)
                self.send_header("Content-Length", str(len(error)))
                self.end_headers()
                self.wfile.write(error)
                return
            connection = http.client.HTTPConnection(host, int(port), timeout=30)
            connection.request(self.command, self.path, body=body or None, headers=dict(self.headers))
            response = connection.getresponse()
            payload = response.read()
            self.send_response(response.status)
            for name, value in response.getheaders():
                if name.lower() not in ("transfer-encoding", "connection"):
                    self.send_header(name, value)
            self.end_headers()
            if fault == "truncate":
                self.wfile.write(payload[: len(payload) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.wfile.write(payload)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = relay

    proxy.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=proxy.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.server.shutdown()
        proxy.server.server_close()
        thread.join(timeout=10)
