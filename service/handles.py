"""The descriptor socket: where a rank trades its one-time claim token for its group's memfds.

Protocol (one exchange per connection): the rank sends its 16-byte token; the daemon checks the
connecting process's SO_PEERCRED against the pid the rank declared at Join, then answers with one
status byte and, on success (0), the descriptors attached with SCM_RIGHTS; on failure (1) the
rest of the message is a UTF-8 reason. Served by threads with blocking sockets, so a slow or
silent client delays nobody and nothing here waits on the event loop.

Each pending claim owns duplicates of its group's descriptors: releasing the group (which closes
the group's own descriptors) can never make a late claim hand out numbers that now name another
group's memory.
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
_CLAIM_IO_TIMEOUT = 2.0
log = logging.getLogger("nodecomm.handles")


@dataclass
class PendingClaim:
    fds: list[int]  # owned by the claim: closed once sent, expired or dropped
    pid: int
    group: str
    group_id: int
    rank: int
    expires_at: float

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class ClaimTable:
    """Tokens issued by Join and not yet claimed. Thread-safe: filled on the loop, drained here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[bytes, PendingClaim] = {}

    def issue(self, group: str, group_id: int, rank: int, pid: int, fds: list[int], ttl: float) -> bytes:
        duplicates: list[int] = []
        try:
            for fd in fds:
                duplicates.append(os.dup(fd))
        except OSError:
            for fd in duplicates:
                os.close(fd)
            raise
        claim = PendingClaim(duplicates, pid, group, group_id, rank, time.monotonic() + ttl)
        token = os.urandom(TOKEN_BYTES)
        with self._lock:
            self._pending[token] = claim
        return token

    def take(self, token: bytes) -> PendingClaim | None:
        """The claim for `token`, now owned by the caller; None if unknown, used or expired."""
        with self._lock:
            claim = self._pending.pop(token, None)
        if claim is not None and claim.expires_at < time.monotonic():
            claim.close()
            return None
        return claim

    def drop_expired(self) -> int:
        now = time.monotonic()
        return self._drop(lambda c: c.expires_at < now)

    def drop_group(self, group_id: int) -> int:
        return self._drop(lambda c: c.group_id == group_id)

    def _drop(self, matches: Callable[[PendingClaim], bool]) -> int:
        with self._lock:
            stale = [t for t, c in self._pending.items() if matches(c)]
            claims = [self._pending.pop(t) for t in stale]
        for claim in claims:
            claim.close()
        return len(claims)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def namespace_pids(pid: int) -> list[int]:
    """The pids of `pid` in every PID namespace it belongs to, outermost first (NSpid)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return [int(p) for p in line.split()[1:]]
    except OSError:
        pass
    return [pid]


def is_declared_process(peer_pid: int, declared_pid: int) -> bool:
    """Whether the connected process is the one that joined: the same pid as this daemon sees it,
    or, for a rank in a container's PID namespace, the pid it sees for itself."""
    return declared_pid == peer_pid or declared_pid == namespace_pids(peer_pid)[-1]


class DescriptorServer:
    def __init__(self, path: str, claims: ClaimTable, on_claim: Callable[[str, str], None]):
        self.path = path
        self._claims = claims
        self._on_claim = on_claim  # (result, detail) for metrics and logs
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o660)
        # The kernel's most (net.core.somaxconn): past the backlog, a client's connect fails at
        # once with EAGAIN, so a burst of connections (ranks claiming together, or garbage) would
        # turn away real claims instead of queueing them for the accept loop.
        self._sock.listen(socket.SOMAXCONN)
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
            except OSError as error:
                if self._stopping:
                    return
                log.warning("descriptor socket accept failed", extra={"error": str(error)})
                time.sleep(0.05)  # EMFILE and friends: let descriptors drain, then serve on
                continue
            threading.Thread(target=self._handle, args=(conn,), name="nodecomm-claim", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
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
        try:
            pid, uid, _ = peer_credentials(conn)
            if not is_declared_process(pid, claim.pid):
                return self._refuse(
                    conn,
                    "wrong_peer",
                    f"claim for group {claim.group!r} rank {claim.rank} was issued to pid {claim.pid}, "
                    f"but pid {pid} (uid {uid}) presented it",
                )
            socket.send_fds(conn, [b"\x00"], claim.fds)
            self._on_claim("ok", f"group {claim.group!r} rank {claim.rank} pid {pid}")
        finally:
            claim.close()

    def _refuse(self, conn: socket.socket, result: str, reason: str) -> None:
        conn.sendall(b"\x01" + reason.encode())
        self._on_claim(result, reason)
