"""Raw-socket helpers for tests that speak HTTP/1.1 by hand (slow clients, oversized headers)."""

from __future__ import annotations

import socket


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (EOF, or a reset after its answer)."""
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk
