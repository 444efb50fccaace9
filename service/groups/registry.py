"""GroupRegistry: groups from their first Join to their last departure.

Lifecycle: ranks arrive (Join) into a forming group; once all `world_size` ranks agree, memory is
allocated and every rank is answered at once; each rank then holds a Session stream.
A session that ends without Leave means a dead rank: the group's abort word is set so peers spinning
in a barrier return an error, and the name is free to form again at once. The memory is released
when every rank is gone. Everything here runs on the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor

from nodecomm import _native
from nodecomm.capabilities import DeviceKind
from nodecomm.credentials import RANK_SECRET_KEY
from nodecomm.errors import (
    AlreadyExistsError,
    DaemonUnavailableError,
    DeadlineExceededError,
    InvalidArgumentError,
    NodecommError,
    NotFoundError,
    PermissionDeniedError,
    shown,
)
from nodecomm.join_rules import MAX_WORLD_SIZE
from nodecomm.service.access.callers import Caller
from nodecomm.service.access.quotas import Quotas
from nodecomm.service.calibration.tables import TableKeeper
from nodecomm.service.calibration.timings import TimingIntake
from nodecomm.service.config import DaemonConfig
from nodecomm.service.groups.adoption import adopted_group, check_rank_proof, record_of
from nodecomm.service.groups.formation import Formation
from nodecomm.service.groups.group import Group
from nodecomm.service.groups.join_args import JoinArgs, validate_join
from nodecomm.service.groups.joining import (
    FormingGroup,
    check_admission,
    check_new_forming,
    join_mismatch,
    join_replies,
    join_timeout,
    retried,
)
from nodecomm.service.groups.listing import group_infos
from nodecomm.service.groups.peer_checks import PeerChecks
from nodecomm.service.groups.rendezvous import OnStop, Rendezvous
from nodecomm.service.groups.state import GroupState
from nodecomm.service.groups.topk_exchanges import TopkOpenings
from nodecomm.service.memory.handles import ClaimTable, HandbackTable
from nodecomm.service.metrics.families import CapturedSizes, DaemonMetrics, abort_label
from nodecomm.service.service_path.memory import ServiceMemory
from nodecomm.service.service_path.submissions import SubmissionQueue
from nodecomm.thresholds import DispatchTable, Path
from nodecomm.v1 import control_pb2 as pb

log = logging.getLogger("nodecomm.groups")


class GroupRegistry:
    def __init__(
        self,
        config: DaemonConfig,
        metrics: DaemonMetrics,
        claims: ClaimTable,
        gpus: list[str],
        executor: Executor,
        adoption_key: bytes,
        handbacks: HandbackTable,
    ):
        self.config = config
        self.adoption_key = adoption_key  # service/groups/adoption.py
        self.handbacks = handbacks  # control pages ranks handed back, for adopt()
        self.executor = executor  # runs the service path's collectives
        self.gpus = gpus  # UUIDs of the GPUs this daemon sees, in its CUDA index order
        self.metrics = metrics
        self.claims = claims
        # Forming and formed groups by (namespace, name): a name is its caller's (callers.py).
        self._forming: dict[tuple[Caller | None, str], FormingGroup] = {}
        self._active: dict[tuple[Caller | None, str], Group] = {}  # the group that owns the name now
        self._groups: dict[int, Group] = {}  # by id: every group not yet released
        self.quotas = Quotas(config, self._groups)
        self.topk_openings = TopkOpenings(config, metrics, claims, self.quotas)
        self._draining = False
        self._stopping = False  # stop(): sessions end, groups run on
        self.tables = TableKeeper(config, metrics, MAX_WORLD_SIZE, len(gpus))
        self.timings = TimingIntake(config, metrics, self.tables)
        metrics.registry.register(CapturedSizes(self.captured_paths))
        self.peer_checks = PeerChecks(metrics, self.tables)
        self.service_memory = ServiceMemory(config, metrics, claims, self.quotas)
        self.formation = Formation(
            config, gpus, self.quotas, self.tables, claims, executor, self._service_done, adoption_key
        )

    # -- thresholds ----------------------------------------------------------------------------

    def _key(self, caller: Caller, name: str) -> tuple[Caller | None, str]:
        """Where a caller's group of this name lives: the caller's namespace, or the one every
        caller shares where groups may mix uids."""
        return (None if self.config.allow_mixed_uids else caller, name)

    def _name_taken(self, caller: Caller, name: str) -> bool:  # forming or formed in the caller's namespace
        return (key := self._key(caller, name)) in self._active or key in self._forming

    def _release_name(self, group: Group) -> None:
        """The group's name is free to form again in its namespace."""
        key = self._key(group.creator, group.name)
        if self._active.get(key) is group:
            del self._active[key]

    def table_for(
        self, caller: Caller, name: str, device_kind: str = DeviceKind.CPU, nccl_fallback: bool = False
    ) -> DispatchTable:
        """The table of `caller`'s formed group `name`, or (no name) the table a new group of
        device_kind would get."""
        if not name:
            return self.tables.preview(device_kind, nccl_fallback)
        group = self._active.get(self._key(caller, name))
        if group is None:
            raise NotFoundError(f"{caller} has no active group named {shown(name)}", group=name)
        return group.table

    # -- join ----------------------------------------------------------------------------------

    async def join(
        self, args: JoinArgs, timeout: float, caller: Caller, group_key: bytes = b"", cap: str = ""
    ) -> pb.JoinReply:
        """Join `caller`'s group `args.group` with `group_key`; `cap` says why the wait is shorter
        than the rank asked (for the message of a wait in vain)."""
        try:
            reply = await self._join(args, timeout, caller, group_key, cap)
        except NodecommError as error:
            self.metrics.joins.labels(type(error).__name__).inc()
            raise
        self.metrics.joins.labels("ok").inc()
        return reply

    async def _join(self, args: JoinArgs, timeout: float, caller: Caller, group_key: bytes, cap: str) -> pb.JoinReply:
        if self._draining:
            raise DaemonUnavailableError(
                "the daemon is shutting down and accepts no joins", group=args.group, rank=args.rank
            )
        validate_join(args, self.config, self.gpus)
        key = self._key(caller, args.group)
        active = self._active.get(key)
        if active is not None:
            raise AlreadyExistsError(
                f"a group with this name is already formed (id {active.group_id}, world_size "
                f"{active.args.world_size}); every rank must leave, or be lost, before it can form again",
                group=args.group,
                rank=args.rank,
            )
        forming = self._forming.get(key)
        if forming is not None and forming.failure is not None:
            forming = retried(forming, args.rank, self.config.join_timeout_seconds)
        key_digest = hashlib.sha256(group_key).digest() if group_key else b""
        if forming is None:
            creators = (group.creator for group in self._groups.values())
            check_new_forming(self.config, creators, self._forming.values(), args, caller, group_key)
            joins = Rendezvous(args.world_size, JoinArgs.AGREED, lambda joined, name: joined.shown(name))
            forming = self._forming[key] = FormingGroup(args.group, joins, caller, key_digest)
        elif forming.arrivals:
            check_admission(forming, args, key_digest)
        other = forming.arrivals.get(args.rank)
        duplicate = (
            f"rank {args.rank} is already joining this group (pid {other.pid}); each rank joins once" if other else ""
        )
        where = dict(group=args.group, rank=args.rank)
        disagreement = forming.joins.arrive(args.rank, args, duplicate, where)
        mismatch = join_mismatch(self.config, forming, args, disagreement)
        if mismatch is not None:
            self._fail_forming(forming, mismatch)
            forming.failed_ranks.add(args.rank)
            raise mismatch
        self._update_gauges()
        if forming.joins.complete:
            self._form(forming)
        try:
            return await forming.joins.wait(
                args.rank,
                timeout,
                OnStop.WITHDRAW,
                timed_out=lambda missing: DeadlineExceededError(
                    join_timeout(forming.joins, args.rank, timeout, cap), **where
                ),
            )
        except (DeadlineExceededError, asyncio.CancelledError):
            self._forget_if_empty(forming)
            raise

    def _fail_forming(self, forming: FormingGroup, error: NodecommError) -> None:
        forming.failed_at = time.monotonic()
        forming.failed_ranks.update(forming.arrivals)
        forming.joins.fail(error)
        forming.arrivals.clear()
        self._update_gauges()
        log.warning("join failed", extra={"group": forming.name, "error": str(error)})

    def _forget_if_empty(self, forming: FormingGroup) -> None:
        """After a rank withdrew: a forming group that no rank waits in any more goes."""
        if not forming.arrivals and forming.failure is None:
            self._drop_forming(forming)
        self._update_gauges()

    def _drop_forming(self, forming: FormingGroup) -> None:
        """`forming` no longer holds its name (formed, failed or empty)."""
        key = self._key(forming.creator, forming.name)
        if self._forming.get(key) is forming:
            del self._forming[key]

    def _form(self, forming: FormingGroup) -> None:
        try:
            group, tokens, max_blocks = self.formation.build(forming)
        except NodecommError as error:
            self._fail_forming(forming, error)
            self._drop_forming(forming)
            return
        first, group_id, memory = group.args, group.group_id, group.memory
        self._drop_forming(forming)
        self._active[self._key(group.creator, group.name)] = group
        self._groups[group_id] = group
        replies = join_replies(self.config, group, tokens, max_blocks)
        forming.joins.succeed(replies)
        for placed in group.placement():
            self.metrics.reserve(*placed)
        self._update_gauges()
        asyncio.get_running_loop().call_later(self.config.session_grace_seconds, self._check_sessions, group_id)
        log.info(
            "group formed",
            extra={
                "group": group.name,
                "group_id": group_id,
                "world_size": first.world_size,
                "capacity_bytes": first.capacity_bytes,
                "reserved_bytes": memory.reserved_bytes,
                "memory_kind": pb.MemoryKind.Name(memory.memory_kind),
                "table_epoch": group.table.epoch,
                "thresholds": [b.describe() for b in group.table.boundaries],
            },
        )

    # -- adoption (service/groups/adoption.py) --------------------------------------------------------

    def adopt(self, request: pb.AdoptRequest, secret: bytes, caller: Caller) -> pb.AdoptReply:
        """A rank hands over a group an earlier daemon formed: the first such call adopts it (record from
        the ticket, control page from the handback, table from the rank); each then opens its session."""
        handback = self.handbacks.take(request.control_token)
        try:
            record = record_of(self.adoption_key, request.ticket)
            where = dict(group=record.join.group, rank=request.rank)
            if len(record.ranks) != record.join.world_size or not 0 <= request.rank < len(record.ranks):
                raise InvalidArgumentError(
                    f"rank {request.rank}: expected one of the group's {len(record.ranks)}", **where
                )
            if self._draining or self._stopping:  # the rank tries the next daemon
                raise DaemonUnavailableError("the daemon is shutting down and adopts no groups", **where)
            check_rank_proof(self.adoption_key, record, request.rank, secret, caller, handback, where)
            known = self._groups.get(record.group_id)
            if known is not None:
                if known.state != GroupState.ACTIVE:
                    raise NotFoundError(f"the group is {known.state}", **where)
                self.metrics.calls_without_daemon.inc(known.handed_over_by(request.rank, request.calls_without_daemon))
                return pb.AdoptReply(group_id=record.group_id, adopted=False)
            group = adopted_group(
                record, request.thresholds, handback.fd, request.ticket, where, self.adoption_key, self.config,
                self.gpus, self.quotas, self.tables, self._name_taken,
            )  # fmt: skip
            handback.fd = -1  # the group's memory holds it now
        finally:
            if handback is not None and handback.fd >= 0:
                os.close(handback.fd)
        self._active[self._key(group.creator, group.name)] = group
        self._groups[group.group_id] = group
        for placed in group.placement():
            self.metrics.reserve(*placed)
        self.metrics.adoptions.inc()
        self.metrics.calls_without_daemon.inc(group.handed_over_by(request.rank, request.calls_without_daemon))
        self._update_gauges()
        asyncio.get_running_loop().call_later(
            self.config.session_grace_seconds, self._check_sessions, group.group_id, "reattach to this daemon"
        )
        log.info(
            "group adopted",
            extra={"group": group.name, "group_id": group.group_id, "world_size": group.args.world_size,
                   "by_rank": request.rank, "table_epoch": group.table.epoch},
        )  # fmt: skip
        return pb.AdoptReply(group_id=group.group_id, adopted=True)

    # -- peer checks (CUDA groups) ---------------------------------------------------------------

    async def check_peers(self, report: pb.PeerCheckReport, timeout: float) -> pb.PeerCheckVerdict:
        """One rank's report of a stage of its group's peer check (peer_checks.py)."""
        group = self._group_of(report.group, report.group_id, report.rank)
        return await self.peer_checks.check(group, report, timeout)

    # -- top-k exchanges -----------------------------------------------------------------------

    async def open_topk_exchange(self, request: pb.TopkExchangeRequest) -> pb.TopkExchangeReply:
        """One rank's call to open a top-k exchange of its group (topk_exchanges.py)."""
        group = self._group_of(request.group, request.group_id, request.rank)
        if group.state != GroupState.ACTIVE:
            raise NotFoundError(f"the group is {group.state}", group=request.group or None, rank=request.rank)
        devices = self._device_indices(group) if group.args.device_kind == DeviceKind.CUDA else []
        return await self.topk_openings.open(group, request, devices)

    def _device_indices(self, group: Group) -> list[int]:
        """The daemon's CUDA index of each rank's GPU, in rank order."""
        return [self.gpus.index(device) for device in group.devices]

    # -- the service path ------------------------------------------------------------------------

    def _group_of(self, name: str, group_id: int, rank: int) -> Group:
        """The group `rank` of `name` (id `group_id`) belongs to, or NotFoundError."""
        group = self._groups.get(group_id)
        if group is None or group.name != name or rank not in group.members:
            raise NotFoundError(
                f"no group named {shown(name)} with id {group_id} has this rank", group=name or None, rank=rank
            )
        return group

    def _service_of(self, name: str, group_id: int, rank: int) -> tuple[Group, SubmissionQueue]:
        where = dict(group=name or None, rank=rank)
        group = self._group_of(name, group_id, rank)
        member = group.members[rank]
        if member.gone:
            raise NotFoundError(f"rank {rank} is no longer a member of this group", **where)
        if group.service is None:
            raise DaemonUnavailableError(
                "the service path died with the daemon that formed this group (it was adopted since); its peer "
                "paths run on",
                **where,
            )
        return group, group.service

    def allocate_memory(self, request: pb.AllocateMemoryRequest) -> pb.AllocateMemoryReply:
        group, service = self._service_of(request.group, request.group_id, request.rank)
        devices = self._device_indices(group) if group.args.device_kind == DeviceKind.CUDA else []
        return self.service_memory.allocate(group, service, request, devices)

    def free_memory(self, request: pb.FreeMemoryRequest) -> None:
        _, service = self._service_of(request.group, request.group_id, request.rank)
        self.service_memory.free(service, request)

    async def submit(self, request: pb.SubmitRequest) -> pb.SubmitReply:
        group, service = self._service_of(request.group, request.group_id, request.rank)
        timeout = request.timeout_seconds if request.timeout_seconds > 0 else self.config.operation_timeout_seconds
        return await service.submit(request, min(timeout, self.config.operation_timeout_seconds))

    def _service_done(self, op: str, result: str, nbytes: int) -> None:
        self.metrics.service_ops.labels(op, result).inc()
        if nbytes:
            self.metrics.service_bytes.labels(op).inc(nbytes)

    # -- who may act as a rank ------------------------------------------------------------------

    def authenticate(self, group_id: int, rank: int, secret: bytes) -> None:
        """Refuse a per-rank call that does not carry the rank's secret from its Join. An unknown
        group or rank passes here: the call itself answers NOT_FOUND."""
        group = self._groups.get(group_id)
        member = group.members.get(rank) if group is not None else None
        if member is not None and not hmac.compare_digest(member.secret, secret):
            raise PermissionDeniedError(
                f"this caller does not hold rank {rank}'s membership: the rank secret from its Join is "
                f"{'wrong' if secret else 'missing'} (metadata {RANK_SECRET_KEY!r})",
                group=group.name,
                rank=rank,
            )

    # -- sessions ------------------------------------------------------------------------------

    def open_session(self, group_id: int, rank: int) -> asyncio.Queue:
        group = self._groups.get(group_id)
        if group is None or rank not in group.members:
            raise NotFoundError(f"no group with id {group_id} has rank {rank}", rank=rank)
        member = group.members[rank]
        if member.session_seen:
            raise AlreadyExistsError("this rank already opened its session", group=group.name, rank=rank)
        if member.gone or group.state != GroupState.ACTIVE:
            raise NotFoundError(
                f"the group is {group.state} and this rank is no longer a member", group=group.name, rank=rank
            )
        member.session = asyncio.Queue()
        member.session_seen = True
        member.session.put_nowait(pb.SessionDown(event=pb.GroupEvent(kind=pb.READY, rank=rank)))
        self._update_gauges()
        return member.session

    def close_session(self, group_id: int, rank: int) -> None:
        """The stream ended. Without a Leave first, the rank is lost."""
        group = self._groups.get(group_id)
        if group is None or rank not in group.members:
            return
        member = group.members[rank]
        member.session = None
        if self._stopping:
            return  # this daemon ended the session; the group runs on without it
        if not member.left and not member.lost:
            member.lost = True
            self._abort(group, _native.AbortReason.PEER_LOST, rank, f"rank {rank}'s session ended without Leave")
        self._release_if_empty(group)
        self._update_gauges()

    def record_counts(self, group_id: int, batch: pb.TimingBatch) -> None:
        """A rank's operation counts and captured sizes."""
        group = self._groups.get(group_id)
        if group is not None:
            self.timings.record_counts(group, batch.counts)
            self.timings.record_captured(group, batch.captured)

    def captured_paths(self) -> Iterator[tuple[str, Path, Path]]:
        """(group, path, the table's path now) of every size a live group's ranks captured."""
        for group in list(self._groups.values()):
            if group.state == GroupState.ACTIVE:
                for nbytes, path in list(group.captured.items()):
                    yield group.name, path, group.table.path_for(nbytes)

    def record_timings(self, group_id: int, rank: int, timings: Sequence[pb.Timing]) -> None:
        self.timings.record_timings(self._groups.get(group_id), rank, timings)

    def _check_sessions(self, group_id: int, what: str = "open its session") -> None:
        group = self._groups.get(group_id)
        if group is None:
            return
        for member in group.members.values():
            if not member.session_seen and not member.gone:
                member.lost = True
                reason = f"rank {member.rank} did not {what} within {self.config.session_grace_seconds:.1f} s"
                log.warning("rank lost", extra={"group": group.name, "group_id": group.group_id, "reason": reason})
                self._abort(group, _native.AbortReason.PEER_LOST, member.rank, reason)
        self._release_if_empty(group)

    # -- leave, abort, release -----------------------------------------------------------------

    def leave(self, name: str, group_id: int, rank: int) -> None:
        group = self._groups.get(group_id)
        if group is None or group.name != name:
            raise NotFoundError(f"no group named {shown(name)} with id {group_id}", group=name or None, rank=rank)
        member = group.members.get(rank)
        if member is None or member.left:
            raise NotFoundError(f"rank {rank} is not a member of this group", group=name, rank=rank)
        member.left = True
        if any(not m.gone for m in group.members.values()):
            # Peers still using the group must not wait for this rank forever.
            self._abort(group, _native.AbortReason.PEER_LEFT, rank, f"rank {rank} left", quiet=True)
        self._release_if_empty(group)
        self._update_gauges()

    def _abort(self, group: Group, reason: int, rank: int, message: str, quiet: bool = False) -> None:
        # A rank's kernel or host may have set the word first (notice_aborts): the first cause is
        # the one told. (A rank that lost its session says "the daemon connection was lost", which
        # the daemon, alive, tells better as the session it saw end.)
        set_by_rank = group.abort_set_by_rank()
        if set_by_rank is not None:
            (reason, rank, message), quiet = set_by_rank, False
        if not group.abort(reason, rank, message):
            return
        self._release_name(group)
        label = abort_label(reason)
        self.metrics.aborts.labels(label).inc()
        where = {"group": group.name, "group_id": group.group_id, "reason": message}
        # A peer that left is an orderly end, not a failure the graphs' replays must hear of.
        if reason != _native.AbortReason.PEER_LEFT:
            group.captured_ranks = group.memory.captured_ranks(group.args.world_size)
        if group.captured_ranks:
            self.metrics.captured_aborts.labels(label).inc()
            log.warning(
                f"captured group {shown(group.name)} aborted: {message}; CUDA graphs of ranks "
                f"{group.captured_ranks} hold its calls, whose replays now return without their result",
                extra={**where, "captured_ranks": group.captured_ranks, "captured_abort": self.config.captured_abort},
            )
        self._update_gauges()
        (log.info if quiet else log.warning)("group aborted", extra=where)

    def notice_aborts(self) -> None:
        """Abort, for the daemon too, the groups whose ranks set their abort word themselves: a
        kernel or a CPU rank that timed out waiting for a peer, ranks that disagreed. Their peers
        stop from the word alone; this tells their sessions why, counts it, and names the groups
        graphs were replaying."""
        for group in list(self._groups.values()):
            if group.state != GroupState.ACTIVE:
                continue
            reason, detail = group.memory.abort_state()
            if reason and reason != _native.AbortReason.DAEMON_LOST:  # that one: close_session
                try:
                    self._abort(group, reason, detail, "")  # _abort tells it in the word's terms
                except Exception:  # one group's page must not stop the daemon noticing the others'
                    log.exception("noticing an abort failed", extra={"group": group.name, "group_id": group.group_id})

    def _release_if_empty(self, group: Group) -> None:
        if group.group_id not in self._groups:
            return
        if all(m.gone and m.session is None for m in group.members.values()):
            self._release_name(group)
            del self._groups[group.group_id]
            self.claims.drop_group(group.group_id)
            self.metrics.forget_group(group.name, group.held(), group.counted, group.wires)
            if group.memory.abort_state()[0] == 0:
                # No rank is left to read it: it marks the page as a released group's, which a
                # replayed ticket cannot bring back (adopt()).
                group.memory.abort(_native.AbortReason.PEER_LEFT, 0)
            group.close()
            self._update_gauges()
            log.info("group released", extra={"group": group.name, "group_id": group.group_id})

    # -- operator views and shutdown -------------------------------------------------------------

    def list_groups(self, caller: Caller, operator: bool = False, group_key: bytes = b"") -> list[pb.GroupInfo]:
        """`caller`'s groups, or every group for an `operator` (groups/listing.py)."""
        return group_infos(self._forming.values(), self._groups.values(), caller, operator, group_key)

    def sweep(self) -> None:
        """Forget failed join attempts whose ranks did not come back within a join timeout."""
        for key, forming in list(self._forming.items()):
            if forming.failed_before(self.config.join_timeout_seconds):
                del self._forming[key]

    def stop(self, drain: bool) -> None:
        """Refuse new joins and end every session. Without `drain` every group runs on: its ranks
        hold its memory and run its peer paths without a daemon (a restart or an upgrade costs
        them no call), but for one on legacy CUDA IPC memory, this process's cudaMalloc, which goes
        with it. With `drain`, every group is aborted (its ranks told) and released."""
        self._draining, self._stopping = True, not drain
        said = "the daemon is shutting down" if drain else "the daemon is stopping"
        for forming in list(self._forming.values()):
            self._fail_forming(forming, DaemonUnavailableError(said, group=forming.name))
        self._forming.clear()
        for group in list(self._groups.values()):
            if drain:
                self._abort(group, _native.AbortReason.SHUTDOWN, 0, said)
            elif group.memory.memory_kind == pb.CUDA_IPC_LEGACY:
                self._abort(group, _native.AbortReason.SHUTDOWN, 0, f"{said} and its memory with it")
            for member in group.members.values():
                if member.session is not None:
                    member.session.put_nowait(None)  # ends the stream
                    member.session = None
                member.lost = member.lost or (drain and not member.left)
            if drain:
                self._release_if_empty(group)
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.count_groups(self._forming.values(), self._groups.values())
