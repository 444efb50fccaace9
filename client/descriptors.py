"""The rank's half of the descriptor socket protocol (the daemon's half: nodecomm.service.handles)."""

from __future__ import annotations

import os
import socket


def claim_descriptors(path: str, token: bytes, max_fds: int, timeout: float) -> list[int]:
    """Present the one-time `token` on the descriptor socket at `path`; returns the descriptors.

    Raises PermissionError with the daemon's reason when the claim is refused.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(token)
        message, fds, _, _ = socket.recv_fds(sock, 4096, max_fds)
    if not message:
        raise ConnectionError(f"descriptor socket {path} closed without answering")
    if message[:1] != b"\x00":
        for fd in fds:
            os.close(fd)
        raise PermissionError(message[1:].decode(errors="replace"))
    return list(fds)
