"""nodecommd: the gRPC control plane over the GroupRegistry, the descriptor socket, /metrics, and
a graceful stop on SIGTERM/SIGINT (health NOT_SERVING, refuse joins, end the sessions, exit 0),
leaving running groups to their ranks, or with drain_on_stop a drain (abort every group first)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import uvloop
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from nodecomm import _native, trust
from nodecomm.capabilities import DeviceKind
from nodecomm.credentials import RANK_SECRET_KEY
from nodecomm.errors import (
    InvalidArgumentError,
    NodecommError,
    PermissionDeniedError,
    status_code_for,
    status_details,
)
from nodecomm.v1 import control_pb2 as pb
from nodecomm.v1 import control_pb2_grpc as pb_grpc

from .adoption import load_key
from .allocator import raise_descriptor_limit
from .calibration import CalibrationStore
from .callers import Caller, Peer
from .config import DaemonConfig, load_config, parse_ids
from .connections import Gate, GateInterceptor
from .groups import GroupRegistry
from .handles import (
    Admission,
    ClaimTable,
    DescriptorServer,
    HandbackTable,
    IdentityTable,
    is_declared_process,
    process_uid,
)
from .job_lease import JobLease
from .join_args import JoinArgs
from .listening import (
    internal_socket,
    listen_unix,
    prepare_socket_path,
    remove_internal_directories,
    restrict_socket_file,
    tls_credentials,
)
from .logs import RateLimitedLog, configure_logging
from .metrics import DaemonMetrics
from .metrics_endpoint import MetricsEndpoint
from .probe import calibration_point
from .timings import MAX_SESSION_MESSAGE_BYTES, PACE_BYTES, CallerPaces, Pace

MAX_MESSAGE_BYTES = 1 << 20

log = logging.getLogger("nodecomm.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Control"].full_name


@dataclass(frozen=True)
class RefusedRequest:
    """What a handler gets for request bytes that do not parse as the method's message (gRPC's own
    deserializer raises there: the caller got UNKNOWN, and the daemon logged a traceback), or that
    are more than the method's requests may be, refused before they are parsed."""

    message: str

    def error(self) -> InvalidArgumentError:
        return InvalidArgumentError(self.message)


def session_messages_per_second(timing_rate_per_rank: int) -> float:
    """How fast a Session stream is read: twice what a client at the timing rate sends (a batch
    per 32 timings, and one a second besides). A stream sent faster waits in HTTP/2 flow control,
    at its sender, instead of in this daemon's event loop."""
    return 2 * (timing_rate_per_rank / 32 + 1)


# The most bytes a request of these methods may be, below the server's MAX_MESSAGE_BYTES: a Session
# stream repeats its messages, so one past what a client ever sends is refused unparsed.
MAX_REQUEST_BYTES = {"Session": MAX_SESSION_MESSAGE_BYTES}
# How often the daemon looks for groups whose ranks aborted them (GroupRegistry.notice_aborts).
ABORT_NOTICE_SECONDS = 0.5


def _lenient_parser(message_class: type[Message], max_bytes: int) -> Callable[[bytes], Message | RefusedRequest]:
    name = message_class.DESCRIPTOR.full_name

    def parse(raw: bytes) -> Message | RefusedRequest:
        if len(raw) > max_bytes:
            return RefusedRequest(
                f"the request's {len(raw)} bytes are more than the {max_bytes} a {name} may be; it was not read"
            )
        try:
            return message_class.FromString(raw)
        except DecodeError as error:
            return RefusedRequest(f"the request's {len(raw)} bytes are not a valid {name}: {error}")

    return parse


def add_control_servicer(servicer: ControlServicer, server: grpc.aio.Server) -> None:
    """control_pb2_grpc.add_ControlServicer_to_server, but requests that do not parse, or are past
    their method's MAX_REQUEST_BYTES, reach the handler as RefusedRequest, which it answers
    INVALID_ARGUMENT."""
    service = pb.DESCRIPTOR.services_by_name["Control"]
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {
        method.name: kinds[method.client_streaming, method.server_streaming](
            getattr(servicer, method.name),
            request_deserializer=_lenient_parser(
                getattr(pb, method.input_type.name), MAX_REQUEST_BYTES.get(method.name, MAX_MESSAGE_BYTES)
            ),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
        for method in service.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def rpc(*, member: bool = False):
    """The one wrapper of every Control handler, unary or streaming: a request that did not parse,
    and any NodecommError the handler raises (before or between its replies), end the call with
    the error's status code and message, counted by method and error; unary calls are timed.
    member=True: the request names a group_id and rank, and the call must carry that rank's
    secret from its Join (metadata RANK_SECRET_KEY)."""

    def wrap(method):
        name = method.__name__

        def admit(self: ControlServicer, request, context: grpc.aio.ServicerContext) -> None:
            if isinstance(request, RefusedRequest):
                raise request.error()
            if member:
                self.registry.authenticate(request.group_id, request.rank, _rank_secret(context))

        if inspect.isasyncgenfunction(method):

            @functools.wraps(method)
            async def streaming(self: ControlServicer, request, context: grpc.aio.ServicerContext):
                try:
                    admit(self, request, context)
                    async for reply in method(self, request, context):
                        yield reply
                except NodecommError as error:
                    await self.refuse(context, name, error)

            return streaming

        @functools.wraps(method)
        async def unary(self: ControlServicer, request, context: grpc.aio.ServicerContext):
            started = time.perf_counter()
            try:
                admit(self, request, context)
                return await method(self, request, context)
            except NodecommError as error:
                await self.refuse(context, name, error)
            finally:
                self.metrics.rpc_seconds.labels(name).observe(time.perf_counter() - started)

        return unary

    return wrap


class ControlServicer(pb_grpc.ControlServicer):
    def __init__(
        self,
        registry: GroupRegistry,
        metrics: DaemonMetrics,
        config: DaemonConfig,
        store: CalibrationStore,
        identities: IdentityTable,
        admission: Admission,
        gate: Gate,
    ):
        self.registry = registry
        self.metrics = metrics
        self.config = config
        self.store = store
        self.identities = identities
        self.admission = admission
        self.gate = gate
        # What every caller's sessions share: one caller's many sessions are read at one pace.
        self.session_paces = CallerPaces(session_messages_per_second(config.timing_rate_per_caller))

    async def refuse(self, context: grpc.aio.ServicerContext, method: str, error: NodecommError) -> None:
        """End the call with the error's status code and message, counted by method and by error."""
        code = status_code_for(error)
        self.metrics.rpc_errors.labels(method, code.name).inc()
        self.metrics.errors.labels(type(error).__name__).inc()
        await context.abort(code, status_details(error))

    @rpc()
    async def Join(self, request: pb.JoinRequest, context) -> pb.JoinReply:
        # The configured join timeout is both the default and the most a rank may ask for.
        timeout = self.config.join_timeout_seconds
        asked = request.join_timeout_seconds if math.isfinite(request.join_timeout_seconds) else 0.0
        if asked > 0:
            timeout = min(timeout, asked)
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, max(remaining - 0.05, 0.0))
        # Said where a rank that waits in vain asked for longer than the daemon allows.
        capped = asked > timeout and timeout == self.config.join_timeout_seconds
        cap = f"the daemon's join_timeout_seconds {timeout:g} s caps the {asked:g} s asked for" if capped else ""
        uid = self._joining_uid(request, self._peer(context))
        return await self.registry.join(
            JoinArgs.from_request(request, uid), timeout, Caller(uid), request.group_key, cap=cap
        )

    def _peer(self, context: grpc.aio.ServicerContext) -> Peer:
        """Who makes this call, as the gate read it when the connection arrived (connections.py)."""
        found = self.gate.peer_of(context.peer())
        if found is None:
            raise PermissionDeniedError("this call did not come through the daemon's sockets; connect to its socket")
        return found

    def _identified_uid(self, token: bytes, pid: int, **where) -> int:
        """The uid an identity from the descriptor socket proves, for the process that declares `pid`."""
        identity = self.identities.take(token)
        if identity is None:
            raise PermissionDeniedError("unknown, already used or expired identity token", **where)
        if not is_declared_process(identity.pid, pid):
            raise PermissionDeniedError(
                f"the identity was issued to pid {identity.pid}, but this request declares pid {pid}", **where
            )
        return identity.uid

    def _check_operator(self, caller: Caller) -> None:
        """Calibrate changes the boundaries of every new group on the node: operator uids only."""
        if caller.uid is None or not self.admission.operates(caller.uid):
            who = sorted(self.admission.operators) or "root and the daemon's own uid"
            raise PermissionDeniedError(
                f"{caller} may not calibrate: calibrating changes every new group's boundaries, which "
                f"only operator uids ({who}) may (the daemon's operator_uids)"
            )

    def _joining_uid(self, request: pb.JoinRequest, peer: Peer) -> int:
        """Who joins, a uid the group's claims are then bound to: the connection's, which an
        identity presented with it (issued on the descriptor socket to the very process that
        declares its pid) must agree with. Without an identity, the declared pid must be a process
        of that uid: the connection's own process on Unix. Over TCP, an identity names a caller the
        connection could not (beyond loopback, where a Join without one is refused: no claim
        could succeed), and is required where the daemon admits only some uids (the gate checked
        Unix callers as they connected). A Join over TCP also needs a group key: whoever reaches
        the port may be anyone."""
        where = dict(group=request.group or None, rank=request.rank)
        caller, transport = peer.caller, peer.transport
        if transport == "tcp" and not request.group_key:
            raise PermissionDeniedError(
                "a Join over TCP must carry a group key: pass connect(group_key=...) or set NODECOMM_GROUP_KEY, "
                "the same on every rank (or connect through the daemon's Unix socket)",
                **where,
            )
        if request.identity:
            uid = self._identified_uid(request.identity, request.pid, **where)
            if caller.uid is not None and uid != caller.uid:
                raise PermissionDeniedError(
                    f"the identity was issued to uid {uid}, but this Join comes from {caller}", **where
                )
            return uid
        if transport == "tcp" and (self.admission.required or caller.uid is None):
            why = (
                "this daemon admits only some uids and groups"
                if caller.uid is not None
                else "the daemon cannot tell which local user calls over TCP beyond loopback, and hands memory only "
                "to the uid that joined"
            )
            raise PermissionDeniedError(
                f"{why}: a Join over TCP must carry the identity the descriptor socket issues (send IDENTIFY "
                "there first), or come through the daemon's Unix socket",
                **where,
            )
        if request.pid <= 0 or (peer.pid is not None and is_declared_process(peer.pid, request.pid)):
            return caller.uid  # the connection's own process (a pid that is none: validate_join says so)
        declared = process_uid(request.pid)
        if declared != caller.uid:
            runs_as = "is no process the daemon can see" if declared is None else f"runs as {Caller(declared)}"
            raise PermissionDeniedError(
                f"this Join declares pid {request.pid}, which {runs_as}, but it comes from {caller}: a Join "
                "declares its own process",
                **where,
            )
        return caller.uid

    @rpc()
    async def Session(self, request_iterator: AsyncIterator[pb.SessionUp], context) -> AsyncIterator[pb.SessionDown]:
        try:
            first = await asyncio.wait_for(anext(aiter(request_iterator), None), self.config.session_grace_seconds)
        except asyncio.TimeoutError:
            first = None
        if isinstance(first, RefusedRequest):
            raise first.error()
        if first is None or first.WhichOneof("kind") != "hello":
            raise InvalidArgumentError("a Session stream must start with a hello naming group_id and rank")
        group_id, rank = first.hello.group_id, first.hello.rank
        caller = self._peer(context).caller
        self.registry.authenticate(group_id, rank, _rank_secret(context))
        queue = self.registry.open_session(group_id, rank)

        refused: list[RefusedRequest] = []

        # This session's pace, and its caller's, which all of that caller's sessions share: each
        # message takes a slot per PACE_BYTES it holds, so the paces bound bytes as well.
        paces = (Pace(session_messages_per_second(self.config.timing_rate_per_rank)), self.session_paces.of(caller))

        async def pump_up() -> None:
            async for message in request_iterator:
                if isinstance(message, RefusedRequest):
                    refused.append(message)  # the stream ends: the rank is lost
                    return
                slots = max(1.0, message.ByteSize() / PACE_BYTES)
                for pace in paces:
                    await pace.wait(slots)
                if message.WhichOneof("kind") == "timings":
                    self.registry.record_timings(group_id, rank, message.timings.timings)
                    self.registry.record_counts(group_id, message.timings)

        upstream = asyncio.ensure_future(pump_up())
        upstream.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while True:
                message = await queue.get()
                if message is None:
                    break
                yield message
            if refused:
                raise refused[0].error()
        finally:
            upstream.cancel()
            self.registry.close_session(group_id, rank)

    @rpc(member=True)
    async def CheckPeers(self, request: pb.PeerCheckReport, context) -> pb.PeerCheckVerdict:
        return await self.registry.check_peers(request, self.config.join_timeout_seconds)

    @rpc(member=True)
    async def OpenTopkExchange(self, request: pb.TopkExchangeRequest, context) -> pb.TopkExchangeReply:
        return await self.registry.open_topk_exchange(request)

    @rpc()
    async def Calibrate(self, request: pb.CalibrateRequest, context) -> AsyncIterator[pb.CalibrateUpdate]:
        self._check_operator(self._peer(context).caller)
        updates: asyncio.Queue[pb.CalibrateUpdate | None] = asyncio.Queue()

        def on_point(label: str, size: int, seconds: float) -> None:
            updates.put_nowait(pb.CalibrateUpdate(point=calibration_point(label, size, seconds)))

        probe = asyncio.ensure_future(self.registry.tables.calibrate(request, self.config.socket, self.store, on_point))
        probe.add_done_callback(lambda _: updates.put_nowait(None))
        try:
            while (update := await updates.get()) is not None:
                yield update
            yield pb.CalibrateUpdate(done=probe.result())
        finally:
            probe.cancel()  # the caller went away: stop the probe

    @rpc(member=True)
    async def AllocateMemory(self, request: pb.AllocateMemoryRequest, context) -> pb.AllocateMemoryReply:
        return self.registry.allocate_memory(request)

    @rpc(member=True)
    async def FreeMemory(self, request: pb.FreeMemoryRequest, context) -> pb.FreeMemoryReply:
        self.registry.free_memory(request)
        return pb.FreeMemoryReply()

    @rpc(member=True)
    async def Submit(self, request: pb.SubmitRequest, context) -> pb.SubmitReply:
        return await self.registry.submit(request)

    @rpc(member=True)
    async def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveReply:
        self.registry.leave(request.group, request.group_id, request.rank)
        return pb.LeaveReply()

    @rpc()
    async def Adopt(self, request: pb.AdoptRequest, context) -> pb.AdoptReply:
        return self.registry.adopt(request, _rank_secret(context), self._peer(context).caller)

    @rpc()
    async def GetThresholds(self, request: pb.GetThresholdsRequest, context) -> pb.ThresholdTable:
        caller = self._peer(context).caller
        table = self.registry.table_for(
            caller, request.group, request.device_kind or DeviceKind.CPU, request.nccl_fallback
        )
        return table.to_proto()

    @rpc()
    async def ListGroups(self, request: pb.ListGroupsRequest, context) -> pb.ListGroupsReply:
        caller = self._peer(context).caller
        operator = caller.uid is not None and self.admission.operates(caller.uid)
        return pb.ListGroupsReply(groups=self.registry.list_groups(caller, operator, request.group_key))


async def _calibrate_on_start(
    registry: GroupRegistry, config: DaemonConfig, store: CalibrationStore, kinds: list[str]
) -> None:
    """No calibration for this machine's fingerprint: probe now, while serving, kind by kind."""
    for kind in kinds:
        log.info("calibrating on start: no stored calibration for this machine", extra={"device_kind": kind})
        try:
            await registry.tables.calibrate(pb.CalibrateRequest(device_kind=kind), config.socket, store)
        except NodecommError as error:
            log.warning(
                "calibration on start failed; built-in defaults stay", extra={"device_kind": kind, "error": str(error)}
            )


def _rank_secret(context: grpc.aio.ServicerContext) -> bytes:
    """The caller's rank secret (JoinReply.rank_secret), from the call's metadata; b"" if none."""
    for key, value in context.invocation_metadata() or ():
        if key == RANK_SECRET_KEY and isinstance(value, bytes):
            return value
    return b""


async def serve(config: DaemonConfig) -> int:
    # Every group, allocation and connection costs descriptors: take all the system allows.
    descriptor_limit = raise_descriptor_limit()
    metrics = DaemonMetrics()
    claims = ClaimTable()
    gpus = _native.cuda_device_uuids() if _native.WITH_CUDA else []
    executor = ThreadPoolExecutor(config.service_threads, thread_name_prefix="nodecomm-service")
    # A job's private daemon keeps its key in its job's directory: it lives as long as that does
    # (a daemon killed leaves it for the next, one that leaves removes it: job_lease.py).
    adoption_key = load_key(os.path.dirname(os.path.abspath(config.socket)) if config.private else config.state_dir)
    handbacks = HandbackTable(_native.CONTROL_BYTES, config.claim_token_ttl_seconds)
    registry = GroupRegistry(config, metrics, claims, gpus, executor, adoption_key, handbacks)
    # Where calibrations are read (the newer of them is used) and written: the node's state, or for
    # a job's private daemon the node's state, read-only, beside the user's own cache.
    store = CalibrationStore(config.state_dir)
    stores = [store]
    if config.private:
        store = CalibrationStore(config.cache_dir, private=True)
        # The node's state is trusted as its daemon is: root's, this user's or NODECOMM_DAEMON_USER's.
        stores = [CalibrationStore(config.state_dir, writable=False, owners=trust.node_daemon_uids()), store]
        registry.tables.live_store = store
    # A calibration measured on this machine before (same fingerprint) is used without probing.
    uncalibrated = registry.tables.reuse_stored(stores)
    for kind in registry.tables.fingerprints:
        log.info("dispatch table in force", extra={"device_kind": kind, "origin": registry.tables.origin(kind)})
    if uncalibrated:
        log.info(
            "no stored calibration for this machine",
            extra={"state_dir": config.state_dir, "device_kinds": uncalibrated},
        )

    # gRPC listens where only this uid can connect: every client comes through the gate.
    upstreams = {"unix": internal_socket(config.socket, "grpc")}
    upstreams["tcp"] = upstreams["unix"]
    if config.tcp_address and config.tls_cert:
        upstreams["tcp"] = internal_socket(config.socket, "grpc-tls")  # TLS ends at gRPC: the gate passes bytes
    for path in (config.socket, config.descriptor_socket, *set(upstreams.values())):
        prepare_socket_path(path, config.socket_group)
    identities = IdentityTable()
    admission = Admission(
        parse_ids("allowed_uids", config.allowed_uids),
        parse_ids("allowed_gids", config.allowed_gids),
        parse_ids("operator_uids", config.operator_uids),
    )
    claim_log = RateLimitedLog(log)  # each outcome at most once a second: floods stay a trickle
    descriptors = DescriptorServer(
        config.descriptor_socket,
        claims,
        on_claim=lambda result, detail: (
            metrics.claims.labels(result).inc(),
            claim_log.log(
                logging.INFO if result in ("ok", "identified", "handed_back") else logging.WARNING,
                result,
                "descriptor claim",
                result=result,
                detail=detail,
            ),
        ),  # fmt: skip
        identities=identities,
        admission=admission,
        identity_ttl=config.claim_token_ttl_seconds,
        handbacks=handbacks,
    )
    restrict_socket_file(config.descriptor_socket, 0o660, config.socket_group)

    # A connection holds three descriptors (the gate's two and gRPC's): a quarter of them at most.
    max_connections = min(config.max_connections, max(64, descriptor_limit // 4))
    if max_connections < config.max_connections:
        log.warning(
            "fewer connections than max_connections: the descriptor limit allows no more",
            extra={"max_connections": max_connections, "descriptor_limit": descriptor_limit},
        )
    gate = Gate(
        upstreams,
        admission,
        max_connections,
        config.max_connections_per_caller,
        on_refusal=lambda reason: metrics.connections_refused.labels(reason).inc(),
        on_count=metrics.connections.set,
    )
    server = grpc.aio.server(
        interceptors=[GateInterceptor(gate)],
        options=[
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            # Every control message is small (the largest a client sends is a batch of 32 timings):
            # a bigger one ends its call before the daemon spends time parsing it.
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # A connection that has not finished its HTTP/2 handshake in 3 s is closed, and one with
            # no call in flight for connection_idle_seconds: connections that only answer pings
            # cannot pile up to the descriptor limit.
            ("grpc.server_handshake_timeout_ms", 3000),
            ("grpc.max_connection_idle_ms", int(config.connection_idle_seconds * 1000)),
        ],
    )
    add_control_servicer(ControlServicer(registry, metrics, config, store, identities, admission, gate), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    server.add_insecure_port(f"unix:{upstreams['unix']}")
    if upstreams["tcp"] != upstreams["unix"]:
        server.add_secure_port(f"unix:{upstreams['tcp']}", tls_credentials(config))

    endpoint = None
    if config.metrics_host_port is not None:
        endpoint = MetricsEndpoint(metrics.registry, *config.metrics_host_port)
        await endpoint.start()

    await server.start()
    for path in set(upstreams.values()):
        os.chmod(path, 0o600)  # the gate's alone (connecting needs write permission, never given)
    await gate.listen_unix(listen_unix(config.socket, config.socket_group))
    if config.tcp_address:
        host, port = config.tcp_address.rsplit(":", 1)
        await gate.listen_tcp(host.strip("[]"), int(port))
    descriptors.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    lease = JobLease(config.socket, config.private_grace_seconds, stop.set) if config.private else None
    if lease is not None:
        await lease.start()

    async def sweep_tokens() -> None:
        while True:
            await asyncio.sleep(max(1.0, config.claim_token_ttl_seconds / 4))
            dropped = claims.drop_expired() + handbacks.drop_expired()
            if dropped:
                metrics.claims.labels("expired").inc(dropped)
            registry.sweep()

    async def notice_aborts() -> None:
        while True:
            await asyncio.sleep(ABORT_NOTICE_SECONDS)
            registry.notice_aborts()

    sweeper = asyncio.ensure_future(sweep_tokens())
    noticer = asyncio.ensure_future(notice_aborts())
    log.info(
        "nodecommd serving",
        extra={
            "socket": config.socket,
            "descriptor_socket": config.descriptor_socket,
            "tcp_address": config.tcp_address or None,
            "metrics_address": (
                f"{endpoint.address[0]}:{endpoint.address[1]}" if endpoint and endpoint.address else None
            ),
            "pid": os.getpid(),
            "private": config.private,
            "gpus": gpus,
            "thresholds": {
                kind: [b.describe() for b in registry.tables.default_boundaries(kind).values()] for kind in DeviceKind
            },
        },
    )
    probe = None
    if uncalibrated and config.calibrate_on_start:
        probe = asyncio.ensure_future(_calibrate_on_start(registry, config, store, uncalibrated))
    await stop.wait()
    if probe is not None:
        probe.cancel()

    await health_servicer.enter_graceful_shutdown()
    log.info("draining" if config.drain_on_stop else "stopping: running groups go on without this daemon")
    registry.stop(drain=config.drain_on_stop)
    await server.stop(config.drain_grace_seconds)
    await gate.close()
    sweeper.cancel()
    noticer.cancel()
    descriptors.stop()
    executor.shutdown(wait=True)
    if endpoint is not None:
        await endpoint.close()
    for path in (config.socket, *set(upstreams.values())):
        if os.path.exists(path):
            os.unlink(path)
    remove_internal_directories(upstreams.values())
    if lease is not None:
        lease.close()
    log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(argv)
        configure_logging(config.log_level, config.log_format)
        return uvloop.run(serve(config))
    except (ValueError, OSError, NodecommError) as error:
        print(f"nodecommd: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
