"""The daemon's listening sockets, in front of its gRPC server.

Each connection's caller is read as it arrives: SO_PEERCRED on the Unix socket, and on loopback
TCP the owner of the peer's socket in /proc/net/tcp (TCP from elsewhere, which needs TLS, is one
caller: TCP_CALLER). Every connection is spliced to the gRPC server on a socket only the daemon
can open, from an abstract address that names its caller: every handler knows who calls
(`Gate.peer_of`), and no client holds a connection to gRPC itself.

A caller the daemon does not admit, or past its share of connections (max_connections_per_caller)
or the daemon's (max_connections), still reaches gRPC, from an address that marks it refused:
every call on it is answered with the reason (PERMISSION_DENIED or RESOURCE_EXHAUSTED, by
GateInterceptor), and it is closed after REFUSED_LINGER_SECONDS. At most MAX_REFUSING such
connections linger at once; past them a connection is closed at once, unanswered.

A splice reads from one side only while the other takes what it writes, so what one connection
buffers here stays bounded; gRPC closes connections idle past connection_idle_seconds, and a
splice ends with its upstream.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from nodecomm.errors import (
    NodecommError,
    PermissionDeniedError,
    ResourceExhaustedError,
    status_code_for,
    status_details,
)
from nodecomm.service.access.callers import TCP_CALLER, Caller, Peer
from nodecomm.service.logs import RateLimitedLog
from nodecomm.service.memory.handles import Admission, process_groups
from nodecomm.tcp_owners import peer_uid
from nodecomm.trust import peer_credentials

log = logging.getLogger("nodecomm.server")

# What one direction of a splice may hold before it stops reading the other side.
_HIGH_WATER = 256 << 10
# How long a refused connection stays for its calls to be answered why, and how many may at once.
REFUSED_LINGER_SECONDS = 2.0
MAX_REFUSING = 64


@dataclass(frozen=True)
class Refusal:
    """Why a connection was refused as it arrived: the metrics' reason and the callers' error."""

    reason: str  # "not_admitted", "per_caller", "total"
    error: NodecommError


class Gate:
    """Counts the open connections per caller and splices every connection to gRPC, at
    `upstreams`' socket for its transport ("unix" or "tcp")."""

    def __init__(
        self,
        upstreams: dict[str, str],
        admission: Admission,
        max_connections: int,
        max_per_caller: int,
        on_refusal: Callable[[str], None],
        on_count: Callable[[int], None],
    ):
        self.upstreams = upstreams
        self.admission = admission
        self.max_connections = max_connections
        self.max_per_caller = max_per_caller
        self._on_refusal = on_refusal
        self._on_count = on_count
        self._open: Counter[Caller] = Counter()
        self._refusing: dict[str, Refusal] = {}  # by upstream address, while they linger
        self._token = secrets.token_hex(8)  # this daemon's splice addresses: unguessable, unique
        self._sequence = 0
        self._servers: list[asyncio.AbstractServer] = []
        self._links: set[_Splice] = set()
        self._refusal_log = RateLimitedLog(log)

    async def listen_unix(self, sock: socket.socket) -> None:
        server = await asyncio.get_running_loop().create_unix_server(
            lambda: _Splice(self, "unix"), sock=sock, backlog=socket.SOMAXCONN
        )
        self._servers.append(server)

    async def listen_tcp(self, host: str, port: int) -> int:
        """Listen on host:port; returns the port (0 picks one)."""
        server = await asyncio.get_running_loop().create_server(
            lambda: _Splice(self, "tcp"), host, port, backlog=socket.SOMAXCONN
        )
        self._servers.append(server)
        return server.sockets[0].getsockname()[1]

    def _peer_of_connection(self, sock: socket.socket, transport: str) -> Peer:
        if transport == "unix":
            pid, uid, _ = peer_credentials(sock)
            return Peer(Caller(uid), transport, pid)
        uid = peer_uid(sock.getsockname(), sock.getpeername())
        return Peer(Caller(uid) if uid is not None else TCP_CALLER, transport)

    def _refusal(self, sock: socket.socket, transport: str, caller: Caller) -> Refusal | None:
        if transport == "unix" and self.admission.required:
            pid, uid, gid = peer_credentials(sock)
            if not self.admission.admits(uid, process_groups(pid, gid)):
                return Refusal(
                    "not_admitted",
                    PermissionDeniedError(f"{caller} may not use this daemon (its allowed_uids and allowed_gids)"),
                )
        total = sum(self._open.values())
        if total >= self.max_connections:
            return Refusal(
                "total",
                ResourceExhaustedError(f"the daemon holds {total} connections, its max_connections; try again later"),
            )
        if self._open[caller] >= self.max_per_caller:
            return Refusal(
                "per_caller",
                ResourceExhaustedError(
                    f"{caller} holds {self._open[caller]} connections to this daemon, its "
                    "max_connections_per_caller; close some first"
                ),
            )
        return None

    def admit(self, sock: socket.socket, transport: str) -> tuple[Caller, str, Refusal | None] | None:
        """A new connection's caller, the upstream address to splice it from, and why it is
        refused (then it lingers: see the module's doc); None: close it at once. The address
        names the caller, and on Unix its pid: `peer_of` reads them back."""
        peer = self._peer_of_connection(sock, transport)
        caller = peer.caller
        refusal = self._refusal(sock, transport, caller)
        self._sequence += 1
        who = ("" if caller.uid is None else str(caller.uid)) + ("" if peer.pid is None else f".{peer.pid}")
        if refusal is not None:
            self._on_refusal(refusal.reason)
            self._refusal_log.log(logging.WARNING, refusal.reason, "connection refused", reason=str(refusal.error))
            if len(self._refusing) >= MAX_REFUSING:
                return None
            address = f"\0nodecomm-{self._token}-x{who}-{self._sequence}"
            self._refusing[address] = refusal
            return caller, address, refusal
        self._open[caller] += 1
        self._on_count(sum(self._open.values()))
        kind = "u" if transport == "unix" else "t"
        return caller, f"\0nodecomm-{self._token}-{kind}{who}-{self._sequence}", None

    def release(self, caller: Caller, address: str) -> None:
        if self._refusing.pop(address, None) is not None:
            return
        self._open[caller] -= 1
        if not self._open[caller]:
            del self._open[caller]
        self._on_count(sum(self._open.values()))

    def peer_of(self, address: str) -> Peer | None:
        """Who makes a gRPC call whose peer address is `address`; None for a connection that did
        not come through this gate, or was refused."""
        prefix = f"unix-abstract:nodecomm-{self._token}-"
        if not address.startswith(prefix):
            return None
        who = address[len(prefix) :].rsplit("-", 1)[0]
        if who[:1] not in ("u", "t"):
            return None
        uid, _, pid = who[1:].partition(".")
        caller = Caller(int(uid)) if uid else TCP_CALLER
        return Peer(caller, "unix" if who[:1] == "u" else "tcp", int(pid) if pid else None)

    def refusal_of(self, peer: str) -> NodecommError | None:
        """Why the connection of a call whose peer is `peer` was refused; None if it was not (or
        did not come through this gate: its handler then refuses it)."""
        refusal = self._refusing.get("\0" + peer.removeprefix("unix-abstract:"))
        return refusal.error if refusal is not None else None

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for link in list(self._links):
            link.close()
        for server in self._servers:
            await server.wait_closed()


class GateInterceptor(grpc.aio.ServerInterceptor):
    """Answers every call on a refused connection with its refusal, whatever the method (health
    and reflection too)."""

    def __init__(self, gate: Gate):
        self.gate = gate

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        gate = self.gate

        async def refuse(context: grpc.aio.ServicerContext) -> None:
            error = gate.refusal_of(context.peer())
            if error is not None:
                await context.abort(status_code_for(error), status_details(error))

        kind = f"{'stream' if handler.request_streaming else 'unary'}_{'stream' if handler.response_streaming else 'unary'}"
        inner = getattr(handler, kind)
        if handler.response_streaming:

            async def answer(request, context):
                await refuse(context)
                async for reply in inner(request, context):
                    yield reply

        else:

            async def answer(request, context):
                await refuse(context)
                return await inner(request, context)

        return handler._replace(**{kind: answer})


class _Splice(asyncio.Protocol):
    """A client connection and, once made, its upstream connection to gRPC: bytes pass both ways,
    each side read only while the other's write buffer is under _HIGH_WATER."""

    def __init__(self, gate: Gate, transport_kind: str):
        self.gate = gate
        self.kind = transport_kind
        self.client: asyncio.Transport | None = None
        self.upstream: asyncio.Transport | None = None
        self.caller: Caller | None = None
        self.address = ""
        self.pending: list[bytes] = []
        self.closed = False

    # -- the client side -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client = transport
        transport.set_write_buffer_limits(high=_HIGH_WATER)
        try:
            admitted = self.gate.admit(transport.get_extra_info("socket"), self.kind)
        except OSError:  # gone before it could be looked at
            admitted = None
        if admitted is None:
            self.closed = True
            asyncio.get_running_loop().call_soon(transport.close)
            return
        self.caller, self.address, refusal = admitted
        self.gate._links.add(self)
        if refusal is not None:
            asyncio.get_running_loop().call_later(REFUSED_LINGER_SECONDS, self.close)
        transport.pause_reading()  # until the upstream is there
        asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.bind(self.address)
            # A Unix socket connects at once or not at all (EAGAIN: gRPC's backlog is full).
            sock.connect(self.gate.upstreams[self.kind])
        except OSError as error:
            sock.close()
            log.warning("could not reach the gRPC server", extra={"error": str(error)})
            self.close()
            return
        # The transport owns the socket from here on, and is attached (or closed, when the client
        # went meanwhile) only once it is made: closing it while uvloop is still making it closes
        # its descriptor twice, the second time whatever another thread opened under that number.
        upstream, _ = await loop.create_unix_connection(lambda: _Upstream(self), sock=sock)
        self.attach(upstream)

    def data_received(self, data: bytes) -> None:
        if self.upstream is None:
            self.pending.append(data)
        else:
            self.upstream.write(data)

    def eof_received(self) -> bool:
        if self.upstream is not None and self.upstream.can_write_eof():
            self.upstream.write_eof()
            return True  # half-close: the answer may still come
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.close()

    def pause_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.resume_reading()

    # -- both ------------------------------------------------------------------------------------

    def attach(self, upstream: asyncio.Transport) -> None:
        if self.closed:
            upstream.close()
            return
        self.upstream = upstream
        upstream.set_write_buffer_limits(high=_HIGH_WATER)
        for data in self.pending:
            upstream.write(data)
        self.pending = []
        self.client.resume_reading()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.gate._links.discard(self)
        if self.caller is not None:
            self.gate.release(self.caller, self.address)
        for side in (self.client, self.upstream):
            if side is not None:
                side.close()


class _Upstream(asyncio.Protocol):
    def __init__(self, link: _Splice):
        self.link = link

    def data_received(self, data: bytes) -> None:
        if not self.link.closed:
            self.link.client.write(data)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.close()

    def pause_writing(self) -> None:
        self.link.client.pause_reading()

    def resume_writing(self) -> None:
        self.link.client.resume_reading()
