"""Raw-socket helpers for tests that speak HTTP/1.1 by hand (slow clients, oversized headers)."""

from __future__ import annotations

import select
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


def send_until_answered(sock: socket.socket, request: bytes, piece: int = 16384) -> bytes:
    """Send `request` in pieces, stopping early once the server answers or closes (as it may refuse an
    oversized request before it has all been sent); then everything it sends until it closes."""
    for start in range(0, len(request), piece):
        if select.select([sock], [], [], 0)[0]:
            break
        try:
            sock.sendall(request[start : start + piece])
        except (BrokenPipeError, ConnectionResetError):
            break
    return read_until_closed(sock)
