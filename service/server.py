"""The daemon's gRPC servicer: every Control method, behind one wrapper (`rpc`) that refuses what
did not parse, checks a member's rank secret and maps NodecommError to its status code; who the
caller is, access/identity.py decides."""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message

from nodecomm.capabilities import DeviceKind
from nodecomm.errors import (
    InvalidArgumentError,
    NodecommError,
    status_code_for,
    status_details,
)
from nodecomm.service.access.callers import Caller
from nodecomm.service.access.identity import Identity, rank_secret
from nodecomm.service.access.rates import PACE_BYTES, CallerPaces, Pace
from nodecomm.service.calibration.probe import calibration_point
from nodecomm.service.calibration.stored import CalibrationStore
from nodecomm.service.calibration.timings import MAX_SESSION_MESSAGE_BYTES
from nodecomm.service.config import DaemonConfig
from nodecomm.service.groups.join_args import JoinArgs
from nodecomm.service.groups.registry import GroupRegistry
from nodecomm.service.metrics.families import DaemonMetrics
from nodecomm.v1 import control_pb2 as pb
from nodecomm.v1 import control_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 1 << 20

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
                self.registry.authenticate(request.group_id, request.rank, rank_secret(context))

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
        identity: Identity,
    ):
        self.registry = registry
        self.metrics = metrics
        self.config = config
        self.store = store
        self.identity = identity
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
        uid = self.identity.joining_uid(request, self.identity.peer(context))
        return await self.registry.join(
            JoinArgs.from_request(request, uid), timeout, Caller(uid), request.group_key, cap=cap
        )

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
        caller = self.identity.peer(context).caller
        self.registry.authenticate(group_id, rank, rank_secret(context))
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
        self.identity.check_operator(self.identity.peer(context).caller)
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
        return self.registry.adopt(request, rank_secret(context), self.identity.peer(context).caller)

    @rpc()
    async def GetThresholds(self, request: pb.GetThresholdsRequest, context) -> pb.ThresholdTable:
        caller = self.identity.peer(context).caller
        table = self.registry.table_for(
            caller, request.group, request.device_kind or DeviceKind.CPU, request.nccl_fallback
        )
        return table.to_proto()

    @rpc()
    async def ListGroups(self, request: pb.ListGroupsRequest, context) -> pb.ListGroupsReply:
        caller = self.identity.peer(context).caller
        operator = self.identity.operates(caller)
        return pb.ListGroupsReply(groups=self.registry.list_groups(caller, operator, request.group_key))
