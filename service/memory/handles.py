"""The descriptor socket: where a rank trades its one-time claim token for its group's memfds, and
where a process proves who it is before it joins.

Protocol (one exchange per connection): the rank sends 16 bytes, a claim token, IDENTIFY or
HANDBACK (nodecomm.credentials; its control page attached to those bytes, for an Adopt: the daemon
answers 0 and a 16-byte token, or 1 and the reason). For a
token the daemon checks the connecting process's SO_PEERCRED against the uid that joined and the
pid the Join declared, then answers with one status byte and, on success (0), the descriptors
attached with SCM_RIGHTS; on failure (1) the rest of the message is a UTF-8 reason. For IDENTIFY
it checks the process's uid and groups against the daemon's admission lists and answers 0 and a
16-byte identity token (which a Join then carries, binding the rank to that pid), or 1 and the
reason. Served by threads with blocking sockets, so a slow or silent client delays nobody and
nothing here waits on the event loop.

Each pending claim owns duplicates of its group's descriptors: releasing the group (which closes
the group's own descriptors) can never make a late claim hand out numbers that now name another
group's memory.
"""

from __future__ import annotations

import fcntl
import logging
import os
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from nodecomm.credentials import HANDBACK, IDENTIFY
from nodecomm.trust import peer_credentials

TOKEN_BYTES = 16
_CLAIM_IO_TIMEOUT = 2.0
# Connections waiting for their 16 bytes at once; past it the oldest is closed. One uid's share:
# past it, that uid's oldest is, so that one user's flood evicts no one else's claims.
_MAX_PENDING = 1024
_MAX_PENDING_PER_UID = 256
log = logging.getLogger("nodecomm.handles")


@dataclass
class PendingClaim:
    fds: list[int]  # owned by the claim: closed once sent, expired or dropped
    pid: int  # the process the Join declared
    uid: int  # the uid that joined
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

    def issue(self, group: str, group_id: int, rank: int, pid: int, uid: int, fds: list[int], ttl: float) -> bytes:
        duplicates: list[int] = []
        try:
            for fd in fds:
                duplicates.append(os.dup(fd))
        except OSError:
            for fd in duplicates:
                os.close(fd)
            raise
        claim = PendingClaim(duplicates, pid, uid, group, group_id, rank, time.monotonic() + ttl)
        token = os.urandom(TOKEN_BYTES)
        with self._lock:
            self._pending[token] = claim
        return token

    def issue_all(
        self, group: str, group_id: int, processes: dict[int, tuple[int, int]], fds: list[int], ttl: float
    ) -> dict[int, bytes]:
        """A token for `fds` per rank of `processes` (rank -> (pid, uid)), all or none: past an
        OSError (out of descriptors) the tokens issued are taken back before it propagates."""
        tokens: dict[int, bytes] = {}
        try:
            for rank, (pid, uid) in processes.items():
                tokens[rank] = self.issue(group, group_id, rank, pid, uid, fds, ttl)
        except OSError:
            for token in tokens.values():
                claim = self.take(token)
                if claim is not None:
                    claim.close()
            raise
        return tokens

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


@dataclass(frozen=True)
class Identity:
    pid: int
    uid: int
    gids: frozenset[int]
    expires_at: float


class IdentityTable:
    """Identities issued on the descriptor socket and not yet presented at Join. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._issued: dict[bytes, Identity] = {}

    def issue(self, pid: int, uid: int, gids: frozenset[int], ttl: float) -> bytes:
        token = os.urandom(TOKEN_BYTES)
        with self._lock:
            now = time.monotonic()
            for stale in [t for t, i in self._issued.items() if i.expires_at < now]:
                del self._issued[stale]
            self._issued[token] = Identity(pid, uid, gids, now + ttl)
        return token

    def take(self, token: bytes) -> Identity | None:
        """The identity for `token`, once; None if unknown, used or expired."""
        with self._lock:
            identity = self._issued.pop(token, None)
        return identity if identity is not None and identity.expires_at >= time.monotonic() else None


@dataclass
class Handback:
    fd: int  # owned by the table until taken
    pid: int
    uid: int
    expires_at: float


# What a handed-back control page must be: a memfd of CONTROL_BYTES sealed against shrinking and
# growing (host_memory.create_segment's), so that no one can truncate it under the daemon's mapping.
_PAGE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_MAX_HANDBACKS_PER_UID = 64
_MAX_HANDBACKS = 1024


class HandbackTable:
    """Control pages ranks handed back on the descriptor socket, until an Adopt takes them.
    Thread-safe; at most _MAX_HANDBACKS_PER_UID per uid and _MAX_HANDBACKS in all (the oldest is
    closed past either), each for `ttl` seconds (drop_expired)."""

    def __init__(self, page_bytes: int, ttl: float = 60.0) -> None:
        self._lock = threading.Lock()
        self._page_bytes = page_bytes
        self._ttl = ttl
        self._held: dict[bytes, Handback] = {}

    def check(self, fd: int) -> str | None:
        """Why `fd` is not a control page this daemon may map (None: it may)."""
        try:
            info = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as error:
            return f"not a sealed memfd ({error.strerror})"
        if not stat.S_ISREG(info.st_mode) or info.st_size != self._page_bytes or seals & _PAGE_SEALS != _PAGE_SEALS:
            return f"not a control page (a sealed memfd of {self._page_bytes} bytes)"
        return None

    def hold(self, fd: int, pid: int, uid: int) -> bytes:
        token = os.urandom(TOKEN_BYTES)
        now = time.monotonic()
        with self._lock:
            stale = [t for t, h in self._held.items() if h.expires_at < now]
            same = [t for t, h in self._held.items() if h.uid == uid]
            stale += same[: max(0, len(same) - _MAX_HANDBACKS_PER_UID + 1)]
            stale += list(self._held)[: max(0, len(self._held) - _MAX_HANDBACKS + 1)]
            closing = [self._held.pop(t) for t in dict.fromkeys(stale) if t in self._held]
            self._held[token] = Handback(fd, pid, uid, now + self._ttl)
        for handback in closing:
            os.close(handback.fd)
        return token

    def drop_expired(self) -> int:
        now = time.monotonic()
        with self._lock:
            closing = [self._held.pop(t) for t, h in list(self._held.items()) if h.expires_at < now]
        for handback in closing:
            os.close(handback.fd)
        return len(closing)

    def take(self, token: bytes) -> Handback | None:
        """The handback for `token`, now owned by the caller; None if unknown, used or expired."""
        with self._lock:
            handback = self._held.pop(token, None)
        if handback is not None and handback.expires_at < time.monotonic():
            os.close(handback.fd)
            return None
        return handback


@dataclass(frozen=True)
class Admission:
    """Who may use the daemon: anyone who can reach its sockets when both lists are empty;
    otherwise the daemon's own uid, the listed uids, and members of the listed groups. Operators
    (root and the daemon's own uid unless listed) may also change node-wide state, and are always
    admitted."""

    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()
    operators: frozenset[int] = frozenset()

    @property
    def required(self) -> bool:
        return bool(self.uids or self.gids)

    def admits(self, uid: int, gids: frozenset[int]) -> bool:
        return (
            not self.required or uid == os.geteuid() or uid in self.uids or bool(gids & self.gids) or self.operates(uid)
        )

    def operates(self, uid: int) -> bool:
        return uid in (self.operators or {0, os.geteuid()})


def _status_field(pid: int, name: str) -> list[int] | None:
    """The numbers on the `name` line of /proc/<pid>/status; None where the process (as this
    daemon's PID namespace numbers it) or the line is not there."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(f"{name}:"):
                    return [int(value) for value in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return None


def process_groups(pid: int, gid: int) -> frozenset[int]:
    """The primary and supplementary groups of `pid` (only the primary one if /proc hides it)."""
    return frozenset([gid, *(_status_field(pid, "Groups") or ())])


def namespace_pids(pid: int) -> list[int]:
    """The pids of `pid` in every PID namespace it belongs to, outermost first (NSpid)."""
    return _status_field(pid, "NSpid") or [pid]


def process_uid(pid: int) -> int | None:
    """The real uid of process `pid`; None where there is no such process (or /proc hides it)."""
    uids = _status_field(pid, "Uid")
    return uids[0] if uids else None


def is_declared_process(peer_pid: int, declared_pid: int) -> bool:
    """Whether the connected process is the one that joined: the same pid as this daemon sees it,
    or, for a rank in a container's PID namespace, the pid it sees for itself."""
    return declared_pid == peer_pid or declared_pid == namespace_pids(peer_pid)[-1]


class DescriptorServer:
    def __init__(
        self,
        path: str,
        claims: ClaimTable,
        on_claim: Callable[[str, str], None],
        identities: IdentityTable | None = None,
        admission: Admission = Admission(),
        identity_ttl: float = 60.0,
        handbacks: HandbackTable | None = None,
    ):
        self.path = path
        self._claims = claims
        self._identities = identities or IdentityTable()
        self._handbacks = handbacks
        self._admission = admission
        self._identity_ttl = identity_ttl
        self._on_claim = on_claim  # (result, detail) for metrics and logs
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o660)
        # The kernel's most (net.core.somaxconn): past the backlog, a client's connect fails at
        # once with EAGAIN, so a burst of connections (ranks claiming together, or garbage) would
        # turn away real claims instead of queueing them for the accept loop.
        self._sock.listen(socket.SOMAXCONN)
        self._thread = threading.Thread(target=self._serve, name="nodecomm-descriptors", daemon=True)
        self._attached: dict[socket.socket, list[int]] = {}  # descriptors a waiting connection sent
        self._stopping = False
        self._last_warning = 0.0

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
        """One thread for every connection: a selector collects each one's 16 bytes (a connection
        that sends none within _CLAIM_IO_TIMEOUT is closed, and past _MAX_PENDING the oldest one
        waiting is), then the answer goes out at once; silent connections cost a descriptor each
        for two seconds, never a thread."""
        selector = selectors.DefaultSelector()
        self._sock.setblocking(False)
        selector.register(self._sock, selectors.EVENT_READ)
        pending: dict[socket.socket, tuple[float, bytearray, int]] = {}  # in arrival order; the uid last
        try:
            while not self._stopping:
                now = time.monotonic()
                wait = min((deadline for deadline, _, _ in pending.values()), default=now + 1.0) - now
                try:
                    events = selector.select(max(wait, 0.0))
                except OSError:
                    return  # the socket was closed under the selector: stopping
                for key, _ in events:
                    if key.fileobj is self._sock:
                        self._accept(selector, pending)
                    elif key.fileobj in pending:  # not evicted by an accept earlier in this batch
                        self._receive(selector, pending, key.fileobj)
                now = time.monotonic()
                for conn in [c for c, (deadline, _, _) in pending.items() if deadline <= now]:
                    self._drop(selector, pending, conn, "too_slow", "sent no claim token within the deadline")
        finally:
            for conn in list(pending):
                selector.unregister(conn)
                conn.close()
            selector.close()

    def _accept(self, selector: selectors.BaseSelector, pending: dict) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as error:
                if not self._stopping:
                    self._log_limited("descriptor socket accept failed", str(error))
                return  # EMFILE and friends: the expiring connections free descriptors
            uid = peer_credentials(conn)[1]
            same = [waiting for waiting, (_, _, owner) in pending.items() if owner == uid]
            if len(same) >= _MAX_PENDING_PER_UID:
                self._drop(
                    selector, pending, same[0], "too_slow", f"evicted: uid {uid} has too many connections waiting"
                )
            elif len(pending) >= _MAX_PENDING:
                oldest = next(iter(pending))
                self._drop(selector, pending, oldest, "too_slow", "evicted: too many connections waiting")
            conn.setblocking(False)
            selector.register(conn, selectors.EVENT_READ)
            pending[conn] = (time.monotonic() + _CLAIM_IO_TIMEOUT, bytearray(), uid)

    def _receive(self, selector: selectors.BaseSelector, pending: dict, conn: socket.socket) -> None:
        _, token, _ = pending[conn]
        try:
            # A HANDBACK carries its one descriptor with its first bytes (SCM_RIGHTS).
            chunk, fds, _, _ = socket.recv_fds(conn, TOKEN_BYTES - len(token), 1)
        except BlockingIOError:
            return
        except OSError:
            chunk, fds = b"", []
        attached = self._attached.setdefault(conn, [])
        attached += fds
        token += chunk
        if chunk and len(token) < TOKEN_BYTES:
            return
        selector.unregister(conn)
        del pending[conn]
        self._attached.pop(conn, None)
        with conn:
            conn.setblocking(True)
            conn.settimeout(_CLAIM_IO_TIMEOUT)
            try:
                self._exchange(conn, bytes(token), attached)
            except OSError as error:
                self._on_claim("io_error", str(error))
            finally:
                for fd in attached:
                    os.close(fd)

    def _drop(
        self, selector: selectors.BaseSelector, pending: dict, conn: socket.socket, result: str, why: str
    ) -> None:
        selector.unregister(conn)
        del pending[conn]
        for fd in self._attached.pop(conn, []):
            os.close(fd)
        conn.close()
        self._on_claim(result, why)

    def _log_limited(self, message: str, error: str) -> None:
        """A warning at most once a second: a flood must not become a flood of log lines."""
        now = time.monotonic()
        if now - self._last_warning >= 1.0:
            self._last_warning = now
            log.warning(message, extra={"error": error})

    def _exchange(self, conn: socket.socket, token: bytes, attached: list[int]) -> None:
        if len(token) != TOKEN_BYTES:
            return self._refuse(conn, "malformed", f"expected a {TOKEN_BYTES}-byte claim token, got {len(token)} bytes")
        if token == IDENTIFY:
            return self._identify(conn)
        if token == HANDBACK:
            return self._hand_back(conn, attached)
        claim = self._claims.take(token)
        if claim is None:
            return self._refuse(conn, "unknown_token", "unknown, already used or expired claim token")
        try:
            pid, uid, _ = peer_credentials(conn)
            if uid != claim.uid:
                return self._refuse(
                    conn,
                    "wrong_peer",
                    f"claim for group {claim.group!r} rank {claim.rank} was issued to uid {claim.uid}, who joined, "
                    f"but uid {uid} (pid {pid}) presented it",
                )
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

    def _identify(self, conn: socket.socket) -> None:
        pid, uid, gid = peer_credentials(conn)
        gids = process_groups(pid, gid)
        if not self._admission.admits(uid, gids):
            return self._refuse(
                conn,
                "not_admitted",
                f"uid {uid} (groups {sorted(gids)}) may not use this daemon: it admits uids "
                f"{sorted(self._admission.uids)} and members of groups {sorted(self._admission.gids)}",
            )
        conn.sendall(b"\x00" + self._identities.issue(pid, uid, gids, self._identity_ttl))
        self._on_claim("identified", f"pid {pid} uid {uid}")

    def _hand_back(self, conn: socket.socket, attached: list[int]) -> None:
        """A rank's control page, for its Adopt: held under a token, with who handed it."""
        pid, uid, gid = peer_credentials(conn)
        if self._handbacks is None:
            return self._refuse(conn, "malformed", "this daemon takes no control pages")
        if not self._admission.admits(uid, process_groups(pid, gid)):
            return self._refuse(conn, "not_admitted", f"uid {uid} may not use this daemon")
        if len(attached) != 1:
            return self._refuse(conn, "malformed", f"HANDBACK carries one descriptor, not {len(attached)}")
        why = self._handbacks.check(attached[0])
        if why is not None:
            return self._refuse(conn, "malformed", f"the descriptor handed back is {why}")
        token = self._handbacks.hold(attached.pop(), pid, uid)
        conn.sendall(b"\x00" + token)
        self._on_claim("handed_back", f"pid {pid} uid {uid}")

    def _refuse(self, conn: socket.socket, result: str, reason: str) -> None:
        conn.sendall(b"\x01" + reason.encode())
        self._on_claim(result, reason)
