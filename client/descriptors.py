"""The rank's half of the descriptor socket protocol (the daemon's half: nodecomm.service.memory.handles)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from nodecomm import trust
from nodecomm.credentials import HANDBACK, IDENTIFY
from nodecomm.errors import DaemonUnavailableError, NodecommError, PermissionDeniedError


def claim_descriptors(
    path: str, token: bytes, max_fds: int, timeout: float, daemon_uids: frozenset[int] | None = None
) -> list[int]:
    """Present the one-time `token` on the descriptor socket at `path`; returns the descriptors.
    With `daemon_uids`, the socket and the process answering on it are checked first
    (nodecomm.trust). Raises PermissionError with the daemon's reason when the claim is refused."""
    with _connect(path, timeout, daemon_uids) as sock:
        sock.sendall(token)
        message, fds, _, _ = socket.recv_fds(sock, 4096, max_fds)
    if not message:
        raise ConnectionError(f"descriptor socket {path} closed without answering")
    if message[:1] != b"\x00":
        for fd in fds:
            os.close(fd)
        raise PermissionError(message[1:].decode(errors="replace"))
    return list(fds)


def _connect(path: str, timeout: float, daemon_uids: frozenset[int] | None) -> socket.socket:
    if daemon_uids is not None:
        return trust.connect_checked(path, daemon_uids, timeout)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass(frozen=True)
class DescriptorSocket:
    """A daemon's descriptor socket, at `path`, served by one of `daemon_uids`: every exchange
    checks the socket and its peer before it sends anything (nodecomm.trust)."""

    path: str
    daemon_uids: frozenset[int]

    def identify(self, timeout: float, where: dict) -> bytes:
        """An identity token for this process (b"" when there is no descriptor socket there);
        raises PermissionDeniedError with the daemon's reason when it does not admit this
        process's uid and groups, or when the socket or its daemon fails the checks,
        DaemonUnavailableError when the socket is there but this process may not open it."""
        try:
            answer = self._answer(IDENTIFY, [], timeout)
        except (FileNotFoundError, ConnectionRefusedError):
            return b""  # then the Join goes without one, and the daemon says if it needs one
        except NodecommError as error:
            raise error.located(**where) from None
        except OSError as error:
            raise DaemonUnavailableError(f"descriptor socket {self.path}: {error}", **where) from None
        if answer[:1] == b"\x00" and len(answer) == 17:
            return answer[1:]
        raise PermissionDeniedError(f"the daemon refused this process: {answer[1:].decode(errors='replace')}", **where)

    def claim(self, token: bytes, expected: int, timeout: float, where: dict) -> list[int]:
        """claim_descriptors, with failures as nodecomm errors and the count checked."""
        try:
            fds = claim_descriptors(self.path, token, expected, timeout, self.daemon_uids)
        except NodecommError as error:
            raise error.located(**where) from None
        except PermissionError as error:
            raise PermissionDeniedError(f"descriptor claim refused: {error}", **where) from None
        except OSError as error:
            raise DaemonUnavailableError(f"descriptor socket {self.path}: {error}", **where) from None
        if len(fds) != expected:
            for fd in fds:
                os.close(fd)
            raise DaemonUnavailableError(f"expected {expected} descriptors, received {len(fds)}", **where)
        return fds

    def hand_back(self, fd: int, timeout: float, where: dict) -> bytes:
        """Hand `fd` (the group's control page) to the daemon serving here now, for an Adopt:
        returns the token the Adopt carries. The socket and its daemon are checked first."""
        try:
            answer = self._answer(HANDBACK, [fd], timeout)
        except NodecommError as error:
            raise error.located(**where) from None
        except OSError as error:
            raise DaemonUnavailableError(f"descriptor socket {self.path}: {error}", **where) from None
        if answer[:1] == b"\x00" and len(answer) == 17:
            return answer[1:]
        if not answer:  # a daemon leaving, or one that closed a connection it found too slow
            raise DaemonUnavailableError(f"descriptor socket {self.path} closed without answering", **where)
        raise PermissionDeniedError(
            f"the daemon refused the control page: {answer[1:].decode(errors='replace')}", **where
        )

    def _answer(self, message: bytes, fds: list[int], timeout: float) -> bytes:
        """The daemon's whole answer to `message` (`fds` attached) on a checked connection."""
        with _connect(self.path, timeout, self.daemon_uids) as sock:
            if fds:
                socket.send_fds(sock, [message], fds)
            else:
                sock.sendall(message)
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
        return answer
