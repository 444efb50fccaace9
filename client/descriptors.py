"""The rank's half of the descriptor socket protocol (the daemon's half: nodecomm.service.handles)."""

from __future__ import annotations

import os
import socket

from nodecomm.credentials import IDENTIFY
from nodecomm.errors import DaemonUnavailableError, PermissionDeniedError


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


def identify(path: str, timeout: float, where: dict) -> bytes:
    """An identity token for this process from the descriptor socket at `path` (b"" when there is
    no descriptor socket there); raises PermissionDeniedError with the daemon's reason when it does
    not admit this process's uid and groups, DaemonUnavailableError when the socket is there but
    this process may not open it (its mode or group)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(IDENTIFY)
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
    except (FileNotFoundError, ConnectionRefusedError):
        return b""  # then the Join goes without one, and the daemon says if it needs one
    except OSError as error:
        raise DaemonUnavailableError(f"descriptor socket {path}: {error}", **where) from None
    if answer[:1] == b"\x00" and len(answer) == 17:
        return answer[1:]
    raise PermissionDeniedError(f"the daemon refused this process: {answer[1:].decode(errors='replace')}", **where)


def claim(path: str, token: bytes, expected: int, timeout: float, where: dict) -> list[int]:
    """claim_descriptors, with failures as nodecomm errors and the count checked."""
    try:
        fds = claim_descriptors(path, token, expected, timeout)
    except PermissionError as error:
        raise PermissionDeniedError(f"descriptor claim refused: {error}", **where) from None
    except OSError as error:
        raise DaemonUnavailableError(f"descriptor socket {path}: {error}", **where) from None
    if len(fds) != expected:
        for fd in fds:
            os.close(fd)
        raise DaemonUnavailableError(f"expected {expected} descriptors, received {len(fds)}", **where)
    return fds
