"""The descriptor socket: where a rank trades its one-time claim token for its group's memfds.

Protocol (one exchange per connection): the rank sends its 16-byte token; the daemon checks the
connecting process's SO_PEERCRED against the pid the rank declared at Join, then answers with one
status byte and, on success (0), the descriptors attached with SCM_RIGHTS; on failure (1) the
rest of the message is a UTF-8 reason. Served from a thread with blocking sockets: each exchange
is a few microseconds and never waits on the event loop.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

TOKEN_BYTES = 16
_CLAIM_IO_TIMEOUT = 5.0
log = logging.getLogger("nodecomm.handles")


@dataclass
class PendingClaim:
    fds: list[int]
    pid: int
    group: str
    rank: int
    expires_at: float


class ClaimTable:
    """Tokens issued by Join and not yet claimed. Thread-safe: filled on the loop, drained here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[bytes, PendingClaim] = {}

    def issue(self, claim: PendingClaim) -> bytes:
        token = os.urandom(TOKEN_BYTES)
        with self._lock:
            self._pending[token] = claim
        return token

    def take(self, token: bytes) -> PendingClaim | None:
        with self._lock:
            claim = self._pending.pop(token, None)
        if claim is not None and claim.expires_at < time.monotonic():
            return None
        return claim

    def drop_expired(self) -> int:
        now = time.monotonic()
        with self._lock:
            stale = [t for t, c in self._pending.items() if c.expires_at < now]
            for token in stale:
                del self._pending[token]
        return len(stale)

    def drop_group(self, group: str) -> None:
        with self._lock:
            for token in [t for t, c in self._pending.items() if c.group == group]:
                del self._pending[token]

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


class DescriptorServer:
    def __init__(self, path: str, claims: ClaimTable, on_claim: Callable[[str, str], None]):
        self.path = path
        self._claims = claims
        self._on_claim = on_claim  # (result, detail) for metrics and logs
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if os.path.exists(path):
            os.unlink(path)
        self._sock.bind(path)
        os.chmod(path, 0o660)
        self._sock.listen(128)
        self._thread = threading.Thread(target=self._serve, name="nodecomm-descriptors", daemon=True)
        self._stopping = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=2)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _serve(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    self._exchange(conn)
                except OSError as error:
                    self._on_claim("io_error", str(error))

    def _exchange(self, conn: socket.socket) -> None:
        conn.settimeout(_CLAIM_IO_TIMEOUT)
        token = b""
        while len(token) < TOKEN_BYTES:
            chunk = conn.recv(TOKEN_BYTES - len(token))
            if not chunk:
                break
            token += chunk
        if len(token) != TOKEN_BYTES:
            return self._refuse(conn, "malformed", f"expected a {TOKEN_BYTES}-byte claim token, got {len(token)} bytes")
        claim = self._claims.take(token)
        if claim is None:
            return self._refuse(conn, "unknown_token", "unknown, already used or expired claim token")
        pid, uid, _ = peer_credentials(conn)
        if pid != claim.pid:
            return self._refuse(
                conn,
                "wrong_peer",
                f"claim for group {claim.group!r} rank {claim.rank} was issued to pid {claim.pid}, "
                f"but pid {pid} (uid {uid}) presented it",
            )
        socket.send_fds(conn, [b"\x00"], claim.fds)
        self._on_claim("ok", f"group {claim.group!r} rank {claim.rank} pid {pid}")

    def _refuse(self, conn: socket.socket, result: str, reason: str) -> None:
        conn.sendall(b"\x01" + reason.encode())
        self._on_claim(result, reason)
