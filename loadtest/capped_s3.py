"""A loopback stand-in for S3 as it behaves over the network: each connection is capped at a fixed
throughput (S3 gives one connection roughly 100 MB/s) and every response waits a first-byte latency
before its headers, for the loader benchmark's `--capped` mode.

It serves GetObject (whole or `Range: bytes=a-b`, honouring `If-Match`) from objects it fetched once from
the upstream S3 server (`prefetch`, not timed): moto reads a whole object for every GET, ranged or not,
which would make the server, not the capped connections, the bottleneck of a split download. The ETag,
Last-Modified and Content-Type are upstream's. Anything else is relayed to upstream as it is.
`GET /_stats` answers the number of connections accepted so far.

It runs in a process of its own (`python -m loadtest.capped_s3 ...`, `start_capped_s3`), so that pacing
and sending never compete with the loader under test for its interpreter.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import httpx

SEND_BYTES = 64 * 1024
KEPT_HEADERS = ("etag", "last-modified", "content-type")


@dataclass(frozen=True, slots=True)
class Cached:
    body: bytes
    headers: dict[str, str]


class CappedS3:
    def __init__(self, upstream: str, bytes_per_s: float, first_byte_s: float) -> None:
        self.upstream, self.bytes_per_s, self.first_byte_s = upstream, bytes_per_s, first_byte_s
        self.objects: dict[str, Cached] = {}
        self.connections = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> CappedS3:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def prefetch(self, client: Any, bucket: str, keys: list[str]) -> None:
        """Read each object once from upstream (`client`: boto3 S3 on it), headers as upstream sends them."""
        for key in keys:
            response = client.get_object(Bucket=bucket, Key=key)
            sent = response["ResponseMetadata"]["HTTPHeaders"]
            kept = {name: sent[name] for name in KEPT_HEADERS if name in sent}
            self.objects[f"/{bucket}/{key}"] = Cached(response["Body"].read(), kept)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: the cap is per connection, as S3's is

            def setup(self) -> None:
                super().setup()
                with proxy._lock:
                    proxy.connections += 1

            def do_GET(self) -> None:
                if self.path == "/_stats":
                    self._send(
                        200, "application/json", json.dumps({"connections": proxy.connections}).encode()
                    )
                    return
                cached = proxy.objects.get(urlsplit(self.path).path)
                if cached is None:
                    self._relay()
                    return
                time.sleep(proxy.first_byte_s)
                if "If-Match" in self.headers and self.headers["If-Match"] != cached.headers.get("etag"):
                    self._error(412, "PreconditionFailed")
                    return
                size, begin, end = len(cached.body), 0, len(cached.body)
                status = 200
                if "Range" in self.headers:
                    first, _, last = self.headers["Range"].removeprefix("bytes=").partition("-")
                    begin, end = int(first), min(int(last) + 1 if last else size, size)
                    if begin >= size:
                        self._error(416, "InvalidRange")
                        return
                    status = 206
                self.send_response(status)
                for name, value in cached.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(end - begin))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {begin}-{end - 1}/{size}")
                self.end_headers()
                self._paced(memoryview(cached.body)[begin:end])

            def _paced(self, body: memoryview) -> None:
                """The body at the cap; a client that closes early (the loader's split) ends it."""
                started = time.perf_counter()
                try:
                    for offset in range(0, len(body), SEND_BYTES):
                        ahead = (offset / proxy.bytes_per_s) - (time.perf_counter() - started)
                        if ahead > 0:
                            time.sleep(ahead)
                        self.wfile.write(body[offset : offset + SEND_BYTES])
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

            def _error(self, status: int, code: str) -> None:
                self._send(status, "application/xml", f"<Error><Code>{code}</Code></Error>".encode())

            def _send(self, status: int, content_type: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                body = self.rfile.read(length) if length else None
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")
                }
                response = httpx.request(
                    self.command, proxy.upstream + self.path, headers=headers, content=body, timeout=120
                )
                self.send_response(response.status_code)
                for name, value in response.headers.items():
                    if name.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(response.content)))
                self.end_headers()
                self.wfile.write(response.content)

            do_HEAD = do_PUT = do_POST = do_DELETE = _relay

            def log_message(self, *args: object) -> None:
                return None

        return Handler


@dataclass
class CappedProcess:
    """`CappedS3` in a child process: its URL, and its connection count on demand."""

    process: subprocess.Popen[str]
    url: str

    @property
    def connections(self) -> int:
        return int(httpx.get(f"{self.url}/_stats", timeout=10).json()["connections"])

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def start_capped_s3(
    upstream: str, bucket: str, keys: list[str], bytes_per_s: float, first_byte_s: float
) -> CappedProcess:
    """Start the stand-in in a child process (S3 credentials from this environment), objects prefetched."""
    argv = [sys.executable, "-m", "loadtest.capped_s3", upstream, bucket, ",".join(keys)]
    argv += [str(bytes_per_s), str(first_byte_s)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return CappedProcess(process, process.stdout.readline().strip())


def main() -> None:
    parser = argparse.ArgumentParser(description="serve a capped S3 stand-in; print its URL")
    for name in ("upstream", "bucket", "keys", "bytes_per_s", "first_byte_s"):
        parser.add_argument(name)
    args = parser.parse_args()
    import boto3

    client = boto3.client("s3", endpoint_url=args.upstream)
    with CappedS3(args.upstream, float(args.bytes_per_s), float(args.first_byte_s)) as proxy:
        proxy.prefetch(client, args.bucket, args.keys.split(","))
        print(proxy.url, flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
