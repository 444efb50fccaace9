"""A formed group as the daemon holds it: its members (each rank's pid, secret, session and
timing budget), its memory, dispatch table, peer checks, top-k exchanges and service path."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

from nodecomm import _native
from nodecomm.capabilities import DeviceKind
from nodecomm.errors import PeerLostError
from nodecomm.service.access.callers import TCP_CALLER, Caller
from nodecomm.service.access.rates import TokenBucket
from nodecomm.service.calibration.live_thresholds import LiveEstimates
from nodecomm.service.groups.join_args import JoinArgs
from nodecomm.service.groups.rendezvous import Rendezvous
from nodecomm.service.groups.state import GroupState
from nodecomm.service.memory.allocator import GroupMemory, TopkSlabs
from nodecomm.service.service_path.submissions import SubmissionQueue
from nodecomm.thresholds import DispatchTable, Path
from nodecomm.v1 import control_pb2 as pb


@dataclass
class Member:
    rank: int
    pid: int = 0  # the process its Join declared
    uid: int = 0  # the uid that joined it
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(16))  # JoinReply.rank_secret
    session: asyncio.Queue | None = None
    session_seen: bool = False
    # The rank's budget of timings (timing_rate_per_rank a second), from its first batch on.
    timing_budget: TokenBucket | None = None
    left: bool = False
    lost: bool = False

    @property
    def gone(self) -> bool:
        return self.left or self.lost


@dataclass
class Group:
    name: str
    group_id: int
    args: JoinArgs  # rank 0's, which every rank agreed with
    memory: GroupMemory
    table: DispatchTable
    members: dict[int, Member]
    state: GroupState = GroupState.ACTIVE
    # Each stage of a CUDA group's peer-memory check: every rank's (ok, detail), then one verdict.
    peer_checks: dict[int, Rendezvous[tuple[bool, str], pb.PeerCheckVerdict]] = field(default_factory=dict)
    exchanges: dict[int, Rendezvous] = field(default_factory=dict)  # top-k exchanges opening, by sequence
    live: LiveEstimates | None = None  # groups with live recalibration on
    topk_slabs: list[TopkSlabs] = field(default_factory=list)
    service: SubmissionQueue | None = None  # collectives the daemon runs
    counted: set[tuple[str, str]] = field(default_factory=set)  # (op, path) series of its operation counts
    wires: set[str] = field(default_factory=set)  # wire series of its all-reduce counts
    devices: list[str] = field(default_factory=list)  # each rank's device: "cpu" or a GPU UUID
    creator: Caller = TCP_CALLER  # the first joiner: the group's name is in its namespace
    captured_ranks: list[int] = field(default_factory=list)  # at its abort: ranks whose calls graphs held
    captured: dict[int, Path] = field(default_factory=dict)  # sizes its ranks captured -> the path taken
    ticket: pb.AdoptionTicket = field(default_factory=pb.AdoptionTicket)  # JoinReply.adoption
    adopted: bool = False  # taken over from an earlier daemon (service/groups/adoption.py)
    handed_over: set[int] = field(default_factory=set)  # of an adopted group: ranks whose Adopt it took

    def handed_over_by(self, rank: int, calls_without_daemon: int) -> int:
        """The calls `rank` made without a daemon to count at its hand-over of the adopted group:
        all at its first, none after (a rank asking again sends its total since the loss)."""
        first = rank not in self.handed_over
        self.handed_over.add(rank)
        return calls_without_daemon if first else 0

    def placement(self, slabs: list[TopkSlabs] | None = None) -> list[tuple[str, str, str, int]]:
        """(kind, device, use, bytes) of the group's memory: the control page and each rank's
        buffer, then each owner's slab of every top-k exchange (of `slabs` when given, and then
        only those). Service allocations are accounted one by one as they come and go."""

        def on(device: str) -> tuple[str, str]:
            return ("host", "host") if device == DeviceKind.CPU else ("cuda", device)

        placed = []
        if slabs is None:
            placed.append(("host", "host", "collectives", self.memory.control_bytes))
            placed += [(*on(device), "collectives", self.memory.buffer_bytes) for device in self.devices]
        for exchange in self.topk_slabs if slabs is None else slabs:
            placed += [(*on(device), "topk", exchange.slab_bytes) for device in self.devices]
        return placed

    def held(self) -> list[tuple[str, str, str, int]]:
        """placement() and the service path's allocations: all that is given back with the group."""
        service = self.service.allocations.values() if self.service is not None else ()
        return self.placement() + [(*allocation.placement, "service", allocation.size_bytes) for allocation in service]

    def close(self) -> None:
        """Give back what the group holds: the service path's stream first (one waiting on a rank
        that left runs out), then its memory, top-k slabs and service allocations."""
        if self.service is not None and self.service.cuda is not None:
            self.service.cuda.release()
        self.memory.close()
        for slabs in self.topk_slabs:
            slabs.close()
        if self.service is not None:
            self.service.close()

    @property
    def reserved_bytes(self) -> int:
        service = self.service.reserved_bytes if self.service is not None else 0
        return self.memory.reserved_bytes + sum(slabs.reserved_bytes for slabs in self.topk_slabs) + service

    def info(self) -> pb.GroupInfo:
        """The operator view (ListGroups, `nodecomm status`)."""
        return pb.GroupInfo(
            name=self.name,
            group_id=self.group_id,
            world_size=self.args.world_size,
            joined_ranks=sorted(self.members),
            live_ranks=sorted(r for r, m in self.members.items() if m.session is not None and not m.gone),
            state=self.state,
            device_kind=self.args.device_kind,
            reserved_bytes=self.reserved_bytes,
            geometry=pb.Geometry(capacity_bytes=self.args.capacity_bytes, dtypes=self.args.dtypes, wire=self.args.wire),
            thresholds=self.table.to_proto(),
            topk_exchanges=len(self.topk_slabs),
            service_bytes=self.service.reserved_bytes if self.service is not None else 0,
            service_ordering=self.service_ordering,
            captured=[pb.CapturedSize(bytes=n, path=path.to_proto()) for n, path in sorted(self.captured.items())],
        )

    @property
    def service_ordering(self) -> int:
        """pb.ServiceOrdering of the service path: how a CUDA group orders its streams."""
        cuda = self.service.cuda if self.service is not None else None
        return cuda.ordering if cuda is not None else pb.SERVICE_ORDERING_UNSPECIFIED

    def abort(self, reason: int, rank: int, message: str) -> bool:
        """Stop the group for `reason` (an _native.AbortReason, for `rank`): its abort word is set,
        its pending service calls and meetings under way (top-k openings, peer checks) fail, and
        the first time its ranks are told. True where it was active until now."""
        self.memory.abort(reason, rank)
        if self.service is not None:
            self.service.fail_pending(PeerLostError(f"group aborted: {message}", group=self.name))
            if self.service.cuda is not None and self.state == GroupState.ACTIVE:
                self.service.cuda.release()
        for meeting in [*self.exchanges.values(), *self.peer_checks.values()]:
            if meeting.failure is None and meeting.waiting():
                meeting.fail(PeerLostError(f"group aborted: {message}", group=self.name))
        if self.state != GroupState.ACTIVE:
            return False
        self.state = GroupState.ABORTED
        kind = pb.DRAINING if reason == _native.AbortReason.SHUTDOWN else pb.PEER_LOST
        self.broadcast(pb.SessionDown(event=pb.GroupEvent(kind=kind, rank=rank, message=message)))
        return True

    def abort_set_by_rank(self) -> tuple[int, int, str] | None:
        """An abort a rank set on the page itself (a kernel or host that timed out waiting for a
        peer, ranks that disagreed): its reason, the rank it names as lost and its words; None
        where none did, or where a rank that lost its session did (the daemon, alive, tells that
        better as the session it saw end)."""
        reason, detail = self.memory.abort_state()
        if not reason or reason == _native.AbortReason.DAEMON_LOST:
            return None
        _, words = _native.abort_error(self.memory.control_address, reason, detail)
        return reason, self._lost_rank(reason, detail), words.split(": ", 1)[-1]  # after "group aborted: "

    def _lost_rank(self, reason: int, detail: int) -> int:
        """The rank an abort a rank set names as lost: for a timeout, whom the waiting rank (the
        detail) waited for, where its kernel recorded it. The page is the ranks' to write: a rank
        out of the group's range is told as rank 0's."""
        world = self.args.world_size
        if reason == _native.AbortReason.STALLED and detail < world:
            code, peer, _ = _native.error_record(self.memory.control_address, detail)
            if code == _native.KernelError.TIMEOUT and peer < world:
                return peer
        return detail if detail < world else 0

    def broadcast(self, message: pb.SessionDown) -> None:
        for member in self.members.values():
            if member.session is not None:
                member.session.put_nowait(message)
