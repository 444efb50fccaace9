"""The service path: collectives that ranks submit and the daemon runs on their memory.

A rank first asks for memory (AllocateMemory): the daemon makes a sealed memfd, keeps it mapped,
and the rank claims and maps it too. Each rank then numbers its submits 0, 1, ...; the daemon
pairs the ranks' n-th submits into one collective and checks that they agree (op, dtype, count,
topk) and that every range lies inside the submitting rank's own live allocation. A group's
collectives run one at a time, in sequence order, on the daemon's worker threads (different
groups overlap). Every rank is answered once its collective has run, or with the one error the
whole collective failed with. The queue is a window of `depth` sequences past the next one to
run; a submit beyond it gets RESOURCE_EXHAUSTED.

On CUDA groups the memory is on the ranks' GPUs and nothing waits on the host: see
cuda_execution.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from nodecomm import _native
from nodecomm.capabilities import CAPABILITIES, DeviceKind
from nodecomm.errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    GroupMismatchError,
    InternalError,
    InvalidArgumentError,
    NodecommError,
    NotFoundError,
    ResourceExhaustedError,
)
from nodecomm.service.groups.rendezvous import OnStop, Rendezvous
from nodecomm.service.memory.allocator import RankAllocation, accounted_bytes
from nodecomm.service.service_path.cuda_execution import CudaExecution
from nodecomm.service.service_path.parts import Part
from nodecomm.topk_layout import owned_rows
from nodecomm.v1 import control_pb2 as pb

log = logging.getLogger("nodecomm.submissions")

_ELEMENT_BYTES = {pb.FLOAT32: 4, pb.FLOAT16: 2, pb.BFLOAT16: 2}
OP_NAMES = {pb.ALL_REDUCE: "all_reduce", pb.ALL_GATHER: "all_gather", pb.TOPK_STAGE: "topk_stage"}
# Failed collectives remembered for ranks that have not submitted their part yet.
_FAILED_KEPT = 256
_EVENT_HANDLE_BYTES = 64
# CPU groups run collectives moving at most this much per rank on the event loop itself: two
# thread hops cost more than the copy, and the loop is blocked for microseconds.
_INLINE_BYTES = 64 << 10


def _shown(request: pb.SubmitRequest, name: str) -> str:
    value = getattr(request, name)
    if name == "op":
        return OP_NAMES.get(value, str(value))
    if name == "dtype":
        return pb.DType.Name(value).lower() if value in pb.DType.values() else str(value)
    return str(value)


# What every rank's part of a collective must agree on.
AGREED = ("op", "dtype", "count", "topk")


@dataclass
class Collective:
    """The ranks' n-th submits: their parts meet in `meeting`, which answers every rank."""

    sequence: int
    meeting: Rendezvous[Part, pb.SubmitReply]
    answered: set[int] = field(default_factory=set)  # ranks that have the failure
    running: bool = False

    @property
    def parts(self) -> dict[int, Part]:
        return self.meeting.arrivals

    @property
    def failure(self) -> NodecommError | None:
        return self.meeting.failure


class SubmissionQueue:
    """One group's service path: the ranks' allocations and the queue of submitted collectives.
    Runs on the daemon's event loop; only the collectives themselves run on `executor`."""

    def __init__(
        self,
        group: str,
        world_size: int,
        dtypes: tuple[int, ...],
        depth: int,
        executor: Executor,
        on_done: Callable[[str, str, int], None],
        cuda: CudaExecution | None = None,
    ):
        self.group = group
        self.world_size = world_size
        self.dtypes = dtypes
        self.depth = depth
        self.cuda = cuda
        # A CUDA group's collectives go to its own thread (see CudaExecution), a CPU group's to the pool.
        self._executor = cuda.thread if cuda is not None else executor
        self._ready_events: dict[int, set[bytes]] = {}  # CUDA: each rank's distinct ready events
        self._on_done = on_done  # (op, result, bytes moved per rank) for metrics
        self.allocations: dict[int, RankAllocation] = {}
        self._freed: set[int] = set()
        self._collectives: dict[int, Collective] = {}
        self._next = 0  # the sequence that runs next
        self._runner: asyncio.Task | None = None
        self._closed: NodecommError | None = None

    # -- memory --------------------------------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        return sum(accounted_bytes(a.size_bytes) for a in self.allocations.values())

    def add_allocation(self, allocation: RankAllocation) -> None:
        if self.cuda is not None:
            allocation.unmap_device = self.cuda.unmap
        self.allocations[allocation.allocation_id] = allocation

    def free(self, rank: int, allocation_id: int) -> RankAllocation:
        allocation = self._owned(rank, allocation_id, "free")
        del self.allocations[allocation_id]
        self._freed.add(allocation_id)
        allocation.free()
        return allocation

    def _owned(self, rank: int, allocation_id: int, what: str) -> RankAllocation:
        where = dict(group=self.group, rank=rank)
        allocation = self.allocations.get(allocation_id)
        if allocation_id in self._freed:
            raise NotFoundError(f"allocation {allocation_id} was freed; cannot {what} it", **where)
        if allocation is None or allocation.rank != rank:
            raise NotFoundError(f"rank {rank} holds no allocation {allocation_id} in this group", **where)
        return allocation

    # -- submits -------------------------------------------------------------------------------

    async def submit(self, request: pb.SubmitRequest, timeout: float) -> pb.SubmitReply:
        where = dict(group=self.group, rank=request.rank)
        if self._closed is not None:
            raise self._closed
        sequence = request.sequence
        collective = self._collectives.get(sequence)
        if collective is None:
            if sequence < self._next:
                raise AlreadyExistsError(f"sequence {sequence} already ran; the next is {self._next}", **where)
            if sequence >= self._next + self.depth + _FAILED_KEPT:
                raise InvalidArgumentError(
                    f"sequence {sequence} is far past the next collective {self._next}; each rank numbers "
                    "its submits 0, 1, ...",
                    **where,
                )
            collective = self._collectives[sequence] = Collective(
                sequence, Rendezvous(self.world_size, AGREED, lambda part, name: _shown(part.request, name))
            )
            if sequence >= self._next + self.depth:
                # Failed for every rank, so that the ranks' numbering stays paired.
                self._fail(
                    collective,
                    ResourceExhaustedError(
                        f"collective {sequence} is past this group's queue: collectives {self._next}.."
                        f"{self._next + self.depth - 1} may wait (depth {self.depth}); wait for earlier ones first",
                        group=self.group,
                    ),
                )
        if collective.failure is not None:
            self._answer_failed(collective, request.rank)
            raise collective.failure
        duplicate = f"rank {request.rank} already submitted sequence {sequence}"
        if request.rank in collective.parts:  # before its ranges are looked at: a duplicate changes nothing
            raise AlreadyExistsError(duplicate, **where)
        try:
            part = self._resolve(request)
            disagreement = collective.meeting.arrive(request.rank, part, duplicate, where)
            if disagreement is not None:
                name, each = disagreement
                raise GroupMismatchError(
                    f"ranks disagree on collective {sequence}'s {name}: {each}; nothing ran", group=self.group
                )
        except NodecommError as error:
            self._fail(collective, error)
            self._answer_failed(collective, request.rank)
            raise
        for allocation in part.allocations():
            allocation.users += 1
        if collective.meeting.complete:
            self._kick()

        def timed_out(missing: list[int]) -> NodecommError:
            waited = f"ranks {missing} did not submit it" if missing else "earlier collectives had not run"
            error = DeadlineExceededError(
                f"collective {sequence} timed out after {timeout:.1f} s: {waited}", group=self.group
            )
            self._fail(collective, error)
            return error

        def stopped() -> NodecommError:
            # The caller went away (cancelled, or past its gRPC deadline). Its part must not stay
            # queued: it would hold its allocations mapped for good and keep the sequence waiting.
            error = DeadlineExceededError(
                f"collective {sequence} did not run: rank {request.rank} stopped waiting for it "
                "(its call was cancelled or passed its deadline)",
                group=self.group,
            )
            self._fail(collective, error)
            return error

        # Running means bounded: it only copies and adds.
        return await collective.meeting.wait(
            request.rank, timeout, OnStop.FAIL_ALL, timed_out, stopped, deciding=lambda: collective.running
        )

    def _resolve(self, request: pb.SubmitRequest) -> Part:
        """Check the request against the op's shape and the rank's allocations; the addresses."""
        where = dict(group=self.group, rank=request.rank)
        self._check_readiness(request, where)
        op, count = request.op, request.count
        if op == pb.ALL_REDUCE:
            if request.dtype not in self.dtypes:
                allowed = sorted(pb.DType.Name(d).lower() for d in self.dtypes)
                raise InvalidArgumentError(
                    f"dtype {_shown(request, 'dtype')}: this group was formed for {allowed}", **where
                )
            element = _ELEMENT_BYTES[request.dtype]
            in_bytes = out_bytes = count * element
        elif op == pb.ALL_GATHER:
            if request.dtype != pb.DTYPE_UNSPECIFIED:
                raise InvalidArgumentError("all_gather moves bytes: leave dtype unspecified, count in bytes", **where)
            element, in_bytes, out_bytes = 1, count, count * self.world_size
        elif op == pb.TOPK_STAGE:
            sizes = CAPABILITIES[DeviceKind.CUDA if self.cuda is not None else DeviceKind.CPU].topk_world_sizes
            if self.world_size not in sizes:
                raise InvalidArgumentError(
                    f"top-k stages support world sizes {sorted(sizes)}; this group has {self.world_size}", **where
                )
            if request.topk < 1 or request.dtype != pb.DTYPE_UNSPECIFIED:
                raise InvalidArgumentError(
                    f"topk_stage: expected topk >= 1 (got {request.topk}) and dtype unspecified "
                    "(indices are int32, scores float32)",
                    **where,
                )
            rows = owned_rows(count, self.world_size, request.rank)
            owned = rows.stop - rows.start  # not len(): a count past 2**63 rows overflows it
            element = 4
            in_bytes = 2 * count * request.topk * 4
            out_bytes = 2 * owned * self.world_size * request.topk * 4
        else:
            raise InvalidArgumentError(f"op {request.op}: expected one of {sorted(OP_NAMES.values())}", **where)
        read = self._range(request, request.input, in_bytes, element, "input") if in_bytes else None
        written = self._range(request, request.output, out_bytes, element, "output") if out_bytes else None
        if read and written and read[0] is written[0]:
            a, b = read[1], written[1]
            if a < b + out_bytes and b < a + in_bytes:
                if op != pb.ALL_REDUCE:
                    # The output holds every rank's part (or rows): writing it would overwrite this
                    # rank's input before every rank has read it, on this rank and its peers.
                    raise InvalidArgumentError(
                        f"{OP_NAMES[op]}: input and output overlap; expected disjoint ranges (only an "
                        "all_reduce runs in place)",
                        **where,
                    )
                if a != b:
                    raise InvalidArgumentError(
                        "input and output overlap without being the same range; expected the same offset "
                        "(in place) or disjoint ranges",
                        **where,
                    )
        return Part(request, read, written, in_bytes)

    def _check_readiness(self, request: pb.SubmitRequest, where: dict) -> None:
        """How the submit says its input is ready: nothing (CPU groups), the sequence + 1 its stream
        writes (stream words), or an event's IPC handle (IPC events)."""
        handle, value = request.ready_event, request.ready_value
        ordering = self.cuda.ordering if self.cuda is not None else pb.SERVICE_ORDERING_UNSPECIFIED
        if ordering != pb.IPC_EVENTS and handle:
            raise InvalidArgumentError(
                "ready_event is for CUDA groups ordered by IPC events; leave it empty (see JoinReply.service_ordering)",
                **where,
            )
        if ordering != pb.STREAM_WORDS and value:
            raise InvalidArgumentError(
                "ready_value is for CUDA groups ordered by stream words; leave it 0 (see JoinReply.service_ordering)",
                **where,
            )
        if ordering == pb.STREAM_WORDS and value != request.sequence + 1:
            raise InvalidArgumentError(
                f"ready_value {value}: a CUDA group ordered by stream words expects the submit's sequence + 1 "
                f"({request.sequence + 1}), the value the rank's stream writes once its input is written",
                **where,
            )
        if ordering != pb.IPC_EVENTS:
            return
        if len(handle) != _EVENT_HANDLE_BYTES:
            raise InvalidArgumentError(
                f"ready_event of {len(handle)} bytes: a CUDA group's submit carries the {_EVENT_HANDLE_BYTES}-byte "
                "IPC handle of an event recorded on the rank's stream once its input was written",
                **where,
            )
        # Each is opened once and kept: a rank needs about one per queued submit.
        limit = 2 * self.depth + 2
        seen = self._ready_events.setdefault(request.rank, set())
        if handle not in seen and len(seen) >= limit:
            raise InvalidArgumentError(
                f"rank {request.rank} has used {limit} distinct ready events, this group's limit (twice the "
                "queue depth, and 2); reuse them once their submits are answered",
                **where,
            )
        seen.add(handle)

    def _range(
        self, request: pb.SubmitRequest, ref: pb.MemoryRef, nbytes: int, element: int, name: str
    ) -> tuple[RankAllocation, int]:
        allocation = self._owned(request.rank, ref.allocation_id, f"use as {name} of")
        offset = ref.offset_bytes
        if offset + nbytes > allocation.size_bytes:
            raise InvalidArgumentError(
                f"{name}: {nbytes} bytes at offset {offset} run past allocation {ref.allocation_id}'s "
                f"{allocation.size_bytes} bytes",
                group=self.group,
                rank=request.rank,
            )
        if offset % element:
            raise InvalidArgumentError(
                f"{name}: offset {offset} is not a multiple of the {element}-byte element",
                group=self.group,
                rank=request.rank,
            )
        return allocation, allocation.address + offset

    # -- running -------------------------------------------------------------------------------

    def _kick(self) -> None:
        if self._runner is None or self._runner.done():
            self._runner = asyncio.get_running_loop().create_task(self._run_ready())

    async def _run_ready(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            collective = self._collectives.get(self._next)
            if collective is None or (collective.failure is None and len(collective.parts) < self.world_size):
                return
            if collective.failure is None:
                collective.running = True
                inline = self.cuda is None and collective.parts[0].in_bytes <= _INLINE_BYTES
                try:
                    if inline:
                        reply = self._execute(collective)
                    else:
                        reply = await loop.run_in_executor(self._executor, self._execute, collective)
                except NodecommError as error:
                    self._fail(collective, error)
                except Exception as error:  # a crashed runner would leave the group's queue stuck
                    self._fail(collective, InternalError(f"collective {collective.sequence} failed: {error!r}"))
                else:
                    self._succeed(collective, reply)
                finally:
                    collective.running = False
            self._next += 1
            if collective.failure is not None and len(collective.answered) == self.world_size:
                self._collectives.pop(collective.sequence, None)

    def _execute(self, collective: Collective) -> pb.SubmitReply:
        """Run it (CPU) or enqueue it (CUDA: the reply says what the ranks' streams wait for)."""
        parts = [collective.parts[r] for r in range(self.world_size)]
        if self.cuda is not None:
            return self.cuda.run(collective.sequence, parts)
        first = parts[0].request
        if first.count == 0:
            return pb.SubmitReply(sequence=collective.sequence)
        inputs = [p.input[1] for p in parts]
        outputs = [p.output[1] if p.output is not None else 0 for p in parts]
        if first.op == pb.ALL_REDUCE:
            _native.service_all_reduce(inputs, outputs, first.count, first.dtype)
        elif first.op == pb.ALL_GATHER:
            _native.service_all_gather(inputs, outputs, first.count)
        else:
            _native.service_topk_stage(inputs, outputs, first.count, first.topk)
        return pb.SubmitReply(sequence=collective.sequence)

    def _succeed(self, collective: Collective, reply: pb.SubmitReply) -> None:
        first = collective.parts[0]
        self._on_done(OP_NAMES[first.request.op], "ok", first.in_bytes)
        collective.meeting.succeed(dict.fromkeys(collective.parts, reply))
        self._retire(collective)
        del self._collectives[collective.sequence]

    def _fail(self, collective: Collective, error: NodecommError) -> None:
        if collective.failure is not None:
            return
        op = next((OP_NAMES.get(p.request.op, "unknown") for p in collective.parts.values()), "unknown")
        self._on_done(op, type(error).__name__, 0)
        collective.answered.update(collective.parts)
        collective.meeting.fail(error)
        self._retire(collective)
        self._forget_if_answered(collective)
        self._forget_old_failures()
        self._kick()

    def _answer_failed(self, collective: Collective, rank: int) -> None:
        collective.answered.add(rank)
        self._forget_if_answered(collective)

    def _forget_if_answered(self, collective: Collective) -> None:
        # A failed collective the runner has not passed yet stays: it marks its sequence as done.
        if len(collective.answered) == self.world_size and collective.sequence < self._next:
            self._collectives.pop(collective.sequence, None)

    def _forget_old_failures(self) -> None:
        failed = sorted(s for s, c in self._collectives.items() if c.failure is not None and s < self._next)
        for sequence in failed[: max(0, len(failed) - _FAILED_KEPT)]:
            del self._collectives[sequence]

    def _retire(self, collective: Collective) -> None:
        """The collective's parts no longer need their memory."""
        for part in collective.parts.values():
            for allocation in part.allocations():
                allocation.release()
        collective.parts.clear()

    # -- abort and release ---------------------------------------------------------------------

    def fail_pending(self, error: NodecommError) -> None:
        """The group is over: every queued collective (not the one running) gets `error`, and so
        does every later submit."""
        self._closed = error
        for collective in list(self._collectives.values()):
            if not collective.running:
                self._fail(collective, error)

    def close(self) -> None:
        """Free every allocation; those a running collective still reads go when it finishes."""
        self.fail_pending(NotFoundError("the group was released", group=self.group))
        for allocation in self.allocations.values():
            allocation.free()
        self.allocations.clear()
        if self.cuda is not None:
            self.cuda.close()
