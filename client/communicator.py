"""Communicator: one rank's handle on a group. Collectives run in this process, on the group's
shared buffers; the daemon is only consulted for the dispatch table and holds this rank's session."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings

import grpc
import torch

from nodecomm import _native
from nodecomm.capabilities import DeviceKind
from nodecomm.credentials import rank_metadata
from nodecomm.errors import (
    DaemonUnavailableError,
    InternalError,
    InvalidArgumentError,
    NodecommError,
    shown,
)
from nodecomm.thresholds import DispatchTable, Path
from nodecomm.v1 import control_pb2 as pb
from nodecomm.v1 import control_pb2_grpc as pb_grpc

from . import c10d_module
from .capture_probe import CapturePhases, probe_for_capture
from .daemon_choice import DaemonChoice, JobLeaseHandle
from .daemon_link import DaemonLink
from .descriptors import DescriptorSocket
from .dispatch import PATH_CODES, PATHS, Dispatcher
from .dtypes import DTYPE_CODES
from .group_errors import GroupErrors
from .mapping import SegmentMapping
from .membership import Membership
from .peer_liveness import PeerLiveness
from .service_client import ServiceBuffer, ServiceClient
from .session import Session
from .table_offers import TableOffers
from .tensor_checks import TensorChecks
from .topk_exchange import CudaTopkExchange, TopkExchange, TopkExchanges
from .transport import Transport
from .transport_runs import TransportRuns
from .work import Work

_c10d = c10d_module()  # built only where torch was installed before nodecomm
log = logging.getLogger("nodecomm.client")

_SERVICE = PATH_CODES[Path.SERVICE]
_ALL_REDUCE = pb.ALL_REDUCE
# A lane call's outcomes (native/lane_api.h).
_DONE, _DONE_SWITCH, _UNUSABLE, _SERVICE_DECIDED, _FAILED, _NCCL_DECIDED, _PROBE = range(7)


class Communicator:
    """A rank's membership in a group. Build it with `nodecomm.connect`.

    Collectives must be called by every rank of the group in the same order with the same sizes,
    like torch.distributed's. On a CPU group they block; on a CUDA group they are enqueued on the
    current stream (and can be captured in a CUDA graph). Every wait is bounded by the operation
    timeout the daemon announced, and ends early when a peer dies: a CPU collective raises
    PeerLostError, a CUDA kernel gives up and the next call (or barrier) raises it.
    """

    def __init__(
        self,
        *,
        membership: Membership,
        channel: grpc.Channel,
        control: SegmentMapping,
        descriptor_socket: DescriptorSocket,
        transport: Transport,
        dtypes: frozenset[torch.dtype],
        table: DispatchTable,
        timing_sample_period: int,
        operation_timeout: float,
        table_switch_period: int = 0,
        explore_period: int = 0,
        rank_secret: bytes = b"",
        daemon: DaemonChoice | None = None,
        daemon_lease: JobLeaseHandle | None = None,
        service_ordering: int = pb.SERVICE_ORDERING_UNSPECIFIED,
        captured_abort: _native.CapturedAbortPolicy = _native.CapturedAbortPolicy.EXIT,
        control_fd: int = -1,
        ticket: pb.AdoptionTicket | None = None,
    ):
        self.membership = membership
        self.group, self.rank = membership.group, membership.rank
        self.world_size, self.group_id = membership.world_size, membership.group_id
        self.daemon = daemon  # which daemon this rank uses: the node's or its job's own
        self._metadata = rank_metadata(rank_secret)  # every per-rank call carries it
        self._link = DaemonLink(
            channel, membership, self._metadata, descriptor_socket, daemon, daemon_lease, control_fd, ticket
        )
        self._control = control
        self._teardown = threading.Lock()  # abort() sets the control page's word, close() unmaps it
        self._transport = transport
        self.device = transport.device
        self._tensors = TensorChecks(dtypes, transport, membership.where)
        self._dispatcher = Dispatcher(
            table, transport.paths | {Path.SERVICE}, transport.kind, variant_of=transport.variant,
            wire_paths=transport.wire_paths,
            explore_period=explore_period, switch_period=table_switch_period,
            sample_period=max(1, timing_sample_period),
        )  # fmt: skip
        self._dispatch = self._dispatcher.native  # what every all_reduce asks, without Python
        self._captures = CapturePhases(self._dispatch, transport.kind == DeviceKind.CUDA)
        self._operation_timeout = operation_timeout
        self._closed = False
        self._session = Session(
            self._link.stub, membership, control.address, self._dispatch, self._metadata,
            lambda: self._link.needs_daemon(transport, self._dispatcher.table),
            self._reattach if self._link.adoptable else None,
        )  # fmt: skip
        liveness = PeerLiveness.held(control_fd, membership.rank) if control_fd >= 0 else None
        self._errors = GroupErrors(control.address, membership, transport.kind, self._session, liveness)
        # Collectives the daemon runs (path="service"); a CUDA group's streams ordered by stream
        # words in this rank's buffer, or by IPC events.
        words = transport.service_words if service_ordering == pb.STREAM_WORDS else None
        self._service = ServiceClient(
            self._link.stub, membership, descriptor_socket, operation_timeout, self._metadata, transport.device, words,
        )  # fmt: skip
        # Held by every collective and by close(): a collective runs with the GIL released, and
        # the buffers must not be unmapped under it. Native, so that an all-reduce (the lane, from
        # Python or from the c10d backend) takes it without the GIL.
        self._lock = _native.CallLock()
        self._lane = transport.lane(self._dispatch, control.address, operation_timeout, self._lock)
        # What the lane leaves to Python (barriers, gathers, top-k stages) runs through here.
        self._runs = TransportRuns(
            transport, control.address, self.rank, self._lock, self._check_usable, self._errors.located
        )
        self._offers = TableOffers(control.address, membership, operation_timeout)
        self._exchanges = TopkExchanges(
            membership, self._metadata, descriptor_socket, transport, self._runs.run, operation_timeout, self._lock,
            # A stage through the slabs: every source writes straight into its owners' memory, once.
            count=lambda nbytes: self._session.count(pb.TOPK_STAGE, Path.ONESHOT, nbytes),
            service_stage=self._service_topk_stage, gather=self.all_gather,
        )  # fmt: skip
        # all_reduce's one native call on the table's path (tensor checks, stream, lane).
        device = transport.device.index if transport.kind == DeviceKind.CUDA else -1
        self._tensor_call = _c10d.TensorCall(*self._lane.api(), self._lane, device, [DTYPE_CODES[d] for d in dtypes])
        # Replays of captured calls run without a call here: an abort of a group they hold is
        # made loud by this thread (nodecomm.captured_abort).
        where = f"[group {shown(self.group)}, rank {self.rank}]"
        self._capture_watch = _native.CaptureWatch(control.address, self.rank, where, captured_abort)

    def _start(self, timeout: float) -> None:
        try:
            self._session.start(timeout)
        except NodecommError as refusal:
            self.close()
            raise self._errors.located(refusal) from None
        except (TimeoutError, ConnectionError) as error:
            self.close()
            raise DaemonUnavailableError(f"could not open the session: {error}", **self.membership.where) from None

    # -- collectives -----------------------------------------------------------------------------

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        path: str | None = None,
        wire: str | None = None,
        async_op: bool = False,
    ) -> torch.Tensor | Work:
        """Sum `tensor` across ranks; returns `out` (a new tensor unless given; `out=tensor` is in place).

        tensor: contiguous float32, float16 or bfloat16 tensor on this group's device, the same
        shape on every rank. path: force one ("oneshot", "twoshot", "service", which the daemon
        runs; CUDA groups also "dma", and "nccl" when connected with an nccl_group); by
        default the daemon's table picks by size. Every path but nccl gives the same bits: fp32
        accumulation in rank order 0..n-1, one rounding. wire: "int8" or "fp8" sends this call
        compressed (each rank quantizes its input once in blocks of 32 with one scale; every rank
        sums the dequantized blocks in rank order: the same bits on every rank, an error the docs
        bound), "lossless" never; by default a group connected with wire= gets its compressed wire
        where the table says, any other group never. async_op: return a work whose wait()
        completes the call and returns `out`; only the service path runs in the background, the
        others are complete when the work is returned.
        """
        try:
            forced, wanted = (0, -1) if path is None and wire is None else self._dispatcher.codes(path, wire)
        except NodecommError as error:
            raise self._errors.located(error) from None
        done = self._tensor_call(tensor, out, forced, wanted)
        if type(done) is torch.Tensor:
            return Work.completed(done) if async_op else done
        if done is None:  # declined: the checks say what is wrong with the tensors, or a subclass runs here
            self._tensors.check(tensor, "tensor")
            if out is not tensor:  # in place needs no second check
                out = self._tensors.output(out, tuple(tensor.shape), tensor.dtype)
            try:
                outcome, _, _ = self._lane.all_reduce(
                    tensor.data_ptr(),
                    out.data_ptr(),
                    tensor.numel(),
                    DTYPE_CODES[tensor.dtype],
                    forced,
                    wanted,
                    self._transport.stream(),
                )
            except NodecommError as error:
                raise self._errors.of_lane(error) from None
        else:
            outcome, out, kind, message = done
            if outcome == _FAILED:
                raise self._errors.of_lane(_native.error(kind, message))
        if outcome != _DONE:
            return self._after_lane(outcome, tensor, out, async_op)
        return Work.completed(out) if async_op else out

    def all_reduce_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        out: torch.Tensor | None = None,
        residual_out: torch.Tensor | None = None,
        path: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The all-reduce a tensor-parallel layer ends with, the residual add and the RMSNorm after
        it, as one call: residual_out = all_reduce(x) + residual, out = rms_norm(residual_out) *
        weight; returns (out, residual_out), new tensors unless given (`out=x`, `residual_out=
        residual` work in place).

        x, residual, out, residual_out: contiguous [..., hidden] tensors of one of the group's
        dtypes on its device, the same shape on every rank (ranks that disagree on it, not only on
        the element count, get GroupMismatchError); weight: [hidden] of the same dtype. The numerics
        are stated in nodecomm.rms_norm, whose add_rms_norm applied to all_reduce(x) gives the same
        bits on every rank and path. On a CUDA group, oneshot and twoshot run it as one kernel
        (twoshot splits the rows' norm work across the ranks) where the pointers are 16-byte
        aligned, hidden is a multiple of 8 and the payload fits a slot (twoshot: twice); elsewhere
        the all-reduce runs on its path and a norm kernel follows. It can be captured in a CUDA
        graph. path: force one, as all_reduce's; by default the table's path for x's size (these
        calls are not explored or timed: their time is not an all-reduce's), and inside capture()
        the path an all-reduce of that size was probed to (its first eager call there probes it).
        """
        hidden = self._tensors.rms_norm_operands(x, residual, weight, eps)
        shape, dtype = tuple(x.shape), x.dtype
        out = x if out is x else self._tensors.output(out, shape, dtype)
        residual_out = residual if residual_out is residual else self._tensors.output(residual_out, shape, dtype)
        forced = 0 if path is None else PATH_CODES[self._forced_path(path)]
        args = (x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), residual_out.data_ptr())
        try:
            outcome, taken = self._lane.all_reduce_rms_norm(
                *args, x.numel() // hidden, hidden, float(eps), DTYPE_CODES[dtype], forced, self._transport.stream()
            )
        except NodecommError as error:
            raise self._errors.of_lane(error) from None
        if outcome == _PROBE:  # the size's captured calls, fused or not, take the path its all-reduces favour
            probe_for_capture(self.all_reduce, x, self._dispatcher, self.membership.where)
            return self.all_reduce_rms_norm(x, residual, weight, eps, out=out, residual_out=residual_out, path=path)
        if outcome == _UNUSABLE:
            self._check_usable()
            raise InternalError("the native lane refused a call this communicator takes", **self.membership.where)
        if outcome in (_SERVICE_DECIDED, _NCCL_DECIDED):  # the all-reduce runs there, the norm here
            self.all_reduce(x, out=out, path=PATHS[taken].value)
            self._transport.add_rms_norm(out, residual, weight, float(eps), out, residual_out)
        return out, residual_out

    def _after_lane(self, outcome: int, tensor: torch.Tensor, out: torch.Tensor, async_op: bool) -> torch.Tensor | Work:
        """What the native lane left to Python: a table switch after the call, the reason it did not
        run, or the call itself when decided for the service path (the daemon runs it)."""
        if outcome == _DONE_SWITCH:
            self._agree_on_table()
            return Work.completed(out) if async_op else out
        if outcome == _PROBE:
            probe_for_capture(self.all_reduce, tensor, self._dispatcher, self.membership.where)
            return self.all_reduce(tensor, out=out, async_op=async_op)
        if outcome == _UNUSABLE:
            self._check_usable()
            raise InternalError("the native lane refused a call this communicator takes", **self.membership.where)
        if outcome != _SERVICE_DECIDED:
            raise InternalError(f"unknown outcome {outcome} of a native all-reduce", **self.membership.where)
        work = self._submitted(self._service.all_reduce, tensor, out)
        self._dispatch.count(_ALL_REDUCE, _SERVICE, 0, tensor.nbytes, tensor.nbytes)
        self._maybe_switch_table(self._transport.capturing())
        return work if async_op else work.wait()

    def capture(self) -> contextlib.AbstractContextManager[None]:
        """Around a phase of CUDA-graph captures (an engine's graph_capture(), which enters it
        through the custom all-reduce slot): the first eager call of each size in here (the
        warm-up an engine runs of each shape before capturing it) first times every lossless path
        of that size in CUDA graphs, and the calls of that size captured in here take the fastest
        (client/capture_probe.py), on every rank alike. Entering it again times the sizes afresh.
        Collective in effect: every rank enters it at the same call. Nothing on a CPU group."""
        return self._captures.phase()

    def _reattach(self, calls_without_daemon: int) -> pb_grpc.ControlStub:
        """Hand this rank's group to the daemon serving the socket now (client/daemon_link.py)."""
        return self._link.reattach(
            lambda: self._dispatcher.table, calls_without_daemon, lambda: self._closed, self._service.use
        )

    def native_outcome(self, outcome: int, tensor: torch.Tensor, kind: int, message: str) -> None:
        """What the c10d backend's native call (in place on `tensor`, through lane_api.h) left to
        Python: as _after_lane, or its error."""
        if outcome == _FAILED:
            raise self._errors.of_lane(_native.error(kind, message))
        self._after_lane(outcome, tensor, tensor, False)

    def native_lane(self) -> tuple[object, int, object]:
        """(C ABI capsule, lane address, the lane) of this rank's all-reduce, for the c10d backend,
        which keeps the lane object alive."""
        return (*self._lane.api(), self._lane)

    def _maybe_switch_table(self, capturing: bool) -> None:
        """After every table_switch_period-th all-reduce: after the call, so that what accepts()
        answered before a call is what that call dispatches by."""
        if self._dispatch.switch_due(capturing):
            self._agree_on_table()

    def accepts(self, tensor: torch.Tensor, *, max_bytes: int | None = None) -> bool:
        """Whether all_reduce(tensor) would run here: a contiguous tensor of this group's dtypes on
        its device (of at most `max_bytes`, where given), of a size the dispatch table gives a path
        this rank runs. False for the sizes the table gives NCCL when the caller runs NCCL itself
        (connect(nccl_by_caller=True)): an engine's custom all-reduce slot declines those, and the
        engine's own NCCL takes them. False once closed. One native call for a plain tensor."""
        answer = self._tensor_call.accepts(tensor, -1 if max_bytes is None else max_bytes)
        if answer is not None:
            return answer
        if self._closed or not (isinstance(tensor, torch.Tensor) and self._tensors.reducible(tensor)):
            return False
        nbytes = tensor.numel() * tensor.element_size()
        return (max_bytes is None or nbytes <= max_bytes) and self._dispatcher.accepts(nbytes)

    def slot_all_reduce(self, tensor: torch.Tensor, *, max_bytes: int | None = None) -> torch.Tensor | None:
        """An engine's custom all-reduce slot in one call: the sum of `tensor` as all_reduce(tensor)
        returns it, or None, with nothing run, where accepts(tensor, max_bytes=max_bytes) is False
        (the engine then runs its own all-reduce). Every rank declines the same calls. One native
        call for a plain tensor on the table's peer paths."""
        done = self._tensor_call.slot(tensor, -1 if max_bytes is None else max_bytes)
        return done if type(done) is torch.Tensor else self._slot_finish(tensor, done, max_bytes)

    def engine_slot(self, *, max_bytes: int | None = None) -> _c10d.EngineSlot:
        """The two calls an engine's custom all-reduce slot makes per all-reduce, native:
        `should_custom_ar(tensor)` is accepts(tensor, max_bytes=max_bytes) and
        `custom_all_reduce(tensor)` is slot_all_reduce(tensor, max_bytes=max_bytes)
        (NodecommAllreduce binds them on itself)."""
        return _c10d.EngineSlot(self._tensor_call, self, -1 if max_bytes is None else max_bytes)

    def _slot_finish(self, tensor: torch.Tensor, done: object, max_bytes: int | None) -> torch.Tensor | None:
        """What the slot's native call left: None (a decline, or a tensor subclass it does not
        take), or (outcome, output, error kind, message) of a call it ran or decided."""
        if done is None:
            if type(tensor) is torch.Tensor or not self.accepts(tensor, max_bytes=max_bytes):
                return None
            return self.all_reduce(tensor)  # a tensor subclass: the Python path
        outcome, out, kind, message = done
        if outcome == _FAILED:
            raise self._errors.of_lane(_native.error(kind, message))
        return self._after_lane(outcome, tensor, out, False)  # a switch, or the service path

    def _submitted(self, submit, *args) -> Work:
        with self._lock:
            self._check_usable()
            self._check_daemon("the service path")
            try:
                return submit(*args)
            except NodecommError as error:
                raise self._errors.located(error) from None

    def _check_daemon(self, what: str) -> None:
        """Raise where the daemon that formed the group is gone: `what` needs it."""
        if self._session.lost_reason is not None:  # whatever serves the socket now was never checked
            raise DaemonUnavailableError(
                f"{self._session.lost_reason}: {what} needs the daemon (this group's peer paths run on without it)",
                **self.membership.where,
            )

    def service_buffer(self, size_bytes: int) -> ServiceBuffer:
        """Memory the daemon maps too (host memory on CPU groups, this rank's GPU on CUDA groups):
        tensors made with its tensor() go to the service path by reference, with no copies. free()
        it when done; the daemon frees what is left with the group."""
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes < 1:
            raise InvalidArgumentError(
                f"size_bytes {size_bytes!r}: expected a whole number of bytes, at least 1", **self.membership.where
            )
        return self._submitted(self._service.allocate, size_bytes)

    def all_gather(
        self,
        tensor: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        path: str | None = None,
        async_op: bool = False,
    ) -> torch.Tensor | Work:
        """Gather every rank's `tensor` (any dtype); returns `out` of shape [world_size, *tensor.shape].
        path="service" has the daemon run it; async_op as for all_reduce."""
        if not isinstance(tensor, torch.Tensor) or not self._transport.on_device(tensor) or not tensor.is_contiguous():
            raise InvalidArgumentError(f"tensor must be a contiguous tensor on {self.device}", **self.membership.where)
        out = self._tensors.output(out, (self.world_size, *tensor.shape), tensor.dtype)
        if path is not None:
            if self._forced_path(path) is not Path.SERVICE:
                raise InvalidArgumentError(
                    f"path {path!r}: all_gather takes path='service' or none", **self.membership.where
                )
            work = self._submitted(self._service.all_gather, tensor, out)
            self._session.count(pb.ALL_GATHER, Path.SERVICE, tensor.numel() * tensor.element_size())
            return work if async_op else work.wait()
        self._runs.run(self._transport.all_gather, tensor, out, self._operation_timeout)
        # CPU groups gather through the staging slots, CUDA groups with copy engines.
        gathered_by = Path.DMA if self._transport.kind == DeviceKind.CUDA else Path.ONESHOT
        self._session.count(pb.ALL_GATHER, gathered_by, tensor.numel() * tensor.element_size())
        return Work.completed(out) if async_op else out

    def barrier(self) -> None:
        """Return once every rank has entered the barrier (on a CUDA group: once every rank's
        current stream has reached it)."""
        if self._transport.capturing():
            raise InvalidArgumentError(
                "barrier() waits on the host, which a CUDA graph capture cannot hold; call it outside the capture",
                **self.membership.where,
            )
        self._runs.run(self._barrier, self._operation_timeout)

    def _barrier(self, timeout: float) -> None:
        if not self._transport.barrier(timeout):
            self._check_usable()  # the wait that gave up aborted the group: its abort is the error
            raise InternalError("a barrier gave up without aborting the group", **self.membership.where)

    def topk_exchange(self, max_rows: int, topk: int, *, timeout: float = 60.0) -> TopkExchange | CudaTopkExchange:
        """Open a top-k owner exchange for up to `max_rows` rows of `topk` candidates per rank.

        Collective: every rank calls it in the same order with the same max_rows and topk, or all
        get GroupMismatchError before anything is allocated. See TopkExchange.stage.
        """
        with self._lock:
            self._check_usable()
            self._check_daemon("a new top-k exchange")
            sequence = self._exchanges.next_sequence()
        return self._exchanges.open(self._link.stub, sequence, max_rows, topk, timeout)

    def _service_topk_stage(self, local_idx: torch.Tensor, local_scores: torch.Tensor):
        work = self._submitted(self._service.topk_stage, local_idx, local_scores)
        self._session.count(pb.TOPK_STAGE, Path.SERVICE, 2 * local_idx.numel() * 4)
        return work.wait()

    def _agree_on_table(self) -> None:
        """Every rank switches to the same new table at the same call (client/table_offers.py)."""
        self._session.flush_if_full()
        self._offers.agree(
            self._dispatcher, self._session.offered, self._session.withheld, self._lock, self._check_usable
        )

    @property
    def operation_timeout(self) -> float:
        """Seconds any wait of a collective lasts at most (the daemon's operation timeout)."""
        return self._operation_timeout

    @property
    def paths(self) -> frozenset[Path]:
        """The paths this rank runs (the table may hold others: NCCL where the caller runs it)."""
        return self._dispatcher.paths

    def path_variant(self, path: str, nbytes: int, wire: str | None = None) -> str:
        """How `path` moves an all-reduce of `nbytes` (over `wire`) here: "push" or "pull" for
        oneshot on a CUDA group, "" where a path has one variant (what the bench and calibration report)."""
        try:
            return self._dispatcher.variant(path, nbytes, wire)
        except NodecommError as error:
            raise self._errors.located(error) from None

    def thresholds(self) -> DispatchTable:
        """The dispatch table in force: size ranges -> path, and where each boundary came from."""
        return self._dispatcher.table

    def check(self) -> None:
        """Raise what this communicator's next call would raise (the group aborted: a peer lost or
        left, a mismatch, a timeout, a drain; or closed). Cheap: it reads the control page, with no
        device synchronisation or daemon call. An engine replaying captured graphs under the "log"
        policy (nodecomm.captured_abort) calls it after a step: a replay after an abort returns at
        once, leaving its outputs as they were, and a step whose check raises must not be used."""
        self._check_usable()

    # -- checks ----------------------------------------------------------------------------------

    def _check_usable(self, call_follows: bool = False) -> None:
        self._errors.check(self._closed, call_follows)

    def _forced_path(self, name: str) -> Path:
        try:
            return self._dispatcher.forced_path(name)
        except NodecommError as error:
            raise self._errors.located(error) from None

    # -- teardown --------------------------------------------------------------------------------

    def abort(self) -> None:
        """End the group now for every rank (torch's ProcessGroup.abort()), then close(): the calls
        under way end at once, this rank's saying it aborted, its peers' as if it had left."""
        with self._teardown:
            if not self._closed:
                self._errors.aborted_here = True
                _native.abort_group(self._control.address, _native.AbortReason.PEER_LEFT, self.rank)
        self.close()

    def close(self) -> None:
        """Leave the group, end the session and unmap the buffers. Calling it again does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._capture_watch.stop()  # this rank's own leaving is no abort to report
            self._lane.close()
        # This rank's queued GPU work first: peers may still wait on its signals, and Leave aborts
        # their waits. Bounded: every kernel gives up after its timeout.
        try:
            self._transport.synchronize()
        except RuntimeError as error:  # a broken CUDA context: leave all the same
            log.warning("synchronizing before leave failed", extra={"group": self.group, "error": str(error)})
        # Then this rank's mappings, before Leave: the daemon frees legacy (cudaIpcMemHandle)
        # buffers once every rank has left, and freeing them while a rank holds them open is
        # undefined in CUDA. (VMM mappings would keep their memory alive either way.)
        try:
            self._service.close()
            self._exchanges.close()
            self._transport.close()
        finally:
            if self._session.lost_reason is None and self._session.refusal is None:
                self._link.leave()
            self._session.close()
            with self._teardown:  # not while abort() sets its abort word
                self._control.unmap()
            self._errors.close()
            self._link.close()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True) is False:
            unclosed = f"nodecomm Communicator for group {self.group!r} rank {self.rank} was not closed"
            warnings.warn(f"{unclosed}; call close() or use it as a context manager", ResourceWarning, stacklevel=1)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Communicator(group={self.group!r}, rank={self.rank}, world_size={self.world_size}, pid={os.getpid()}, {state})"
