"""A local stand-in for the SageMaker runtime API, in front of a real `inf2serve serve`: it answers
`POST /endpoints/<name>/invocations-response-stream` (InvokeEndpointWithResponseStream) by sending the
body to the server's `/invocations`, exactly as SageMaker does, and relays the chunked response as AWS
event-stream messages (one `PayloadPart` per chunk, as SageMaker documents), so boto3's own event-stream
parser reads them. moto implements no SageMaker runtime streaming; this is the contract test instead."""

from __future__ import annotations

import struct
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


def _header(name: str, value: str) -> bytes:
    encoded = value.encode()
    return bytes([len(name)]) + name.encode() + b"\x07" + struct.pack(">H", len(encoded)) + encoded


def event_message(payload: bytes) -> bytes:
    """One event-stream message: prelude (lengths + CRC), headers, payload, message CRC."""
    headers = (
        _header(":event-type", "PayloadPart")
        + _header(":content-type", "application/octet-stream")
        + _header(":message-type", "event")
    )
    total = 12 + len(headers) + len(payload) + 4
    prelude = struct.pack(">II", total, len(headers))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + headers + payload
    return message + struct.pack(">I", zlib.crc32(message))


@contextmanager
def sagemaker_runtime(server_url: str) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """The stand-in's endpoint URL, and the SageMaker headers of each request it received."""
    received: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append({k: v for k, v in self.headers.items() if k.lower().startswith("x-amzn")})
            with httpx.stream("POST", f"{server_url}/invocations", content=body, timeout=60) as upstream:
                self.send_response(upstream.status_code)
                self.send_header("Content-Type", "application/vnd.amazon.eventstream")
                self.send_header("X-Amzn-SageMaker-Content-Type", upstream.headers["content-type"])
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for chunk in upstream.iter_raw():
                    self._chunk(event_message(chunk))
                self._chunk(b"")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

        def log_message(self, *args: object) -> None:
            return None

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", received
    finally:
        httpd.shutdown()
        httpd.server_close()
