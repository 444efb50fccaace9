"""Joining a forming group: who may arrive (the group key; the caller's and the daemon's group
limits) and what makes a Join disagree with the ranks already there. The ranks meet in a
Rendezvous; GroupRegistry forms the group once all agree. A Join reaches only groups of its own
caller's namespace (callers.py), so another uid's Join never meets, or learns of, this group."""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from nodecomm.capabilities import DeviceKind
from nodecomm.captured_abort import POLICIES as CAPTURED_ABORT_POLICIES
from nodecomm.errors import GroupMismatchError, NodecommError, PermissionDeniedError, ResourceExhaustedError
from nodecomm.service.access.callers import Caller
from nodecomm.service.config import DaemonConfig
from nodecomm.service.groups.group import Group
from nodecomm.service.groups.join_args import JoinArgs
from nodecomm.service.groups.rendezvous import Rendezvous
from nodecomm.service.groups.state import GroupState
from nodecomm.v1 import control_pb2 as pb


@dataclass
class FormingGroup:
    """Ranks that have arrived for a name that is not formed yet in its creator's namespace,
    meeting in `joins`: admitted only with the first joiner's group key (its digest, compared in
    constant time). Once the attempt failed, every rank of it gets the same error."""

    name: str
    joins: Rendezvous[JoinArgs, pb.JoinReply]
    creator: Caller  # the first joiner
    key_digest: bytes = b""
    failed_ranks: set[int] = field(default_factory=set)
    failed_at: float = 0.0

    @property
    def arrivals(self) -> dict[int, JoinArgs]:
        return self.joins.arrivals

    @property
    def failure(self) -> NodecommError | None:
        return self.joins.failure

    def failed_before(self, seconds: float) -> bool:
        """Whether its forming failed more than `seconds` ago."""
        return self.failure is not None and time.monotonic() - self.failed_at > seconds

    def info(self, detailed: bool) -> pb.GroupInfo:
        """The operator view; the world size and joined ranks only when `detailed`: to anyone
        else those say which rank to pose as."""
        if not detailed:
            return pb.GroupInfo(name=self.name, state=GroupState.JOINING)
        any_args = next(iter(self.arrivals.values()))
        return pb.GroupInfo(
            name=self.name,
            world_size=any_args.world_size,
            joined_ranks=sorted(self.arrivals),
            state=GroupState.JOINING,
            device_kind=any_args.device_kind,
        )


def check_new_forming(
    config: DaemonConfig,
    formed: Iterable[Caller],
    forming: Iterable[FormingGroup],
    args: JoinArgs,
    caller: Caller,
    group_key: bytes,
) -> None:
    """A Join that starts a forming group: refused past the daemon's group limits and the caller's
    shares of them, or without a key where one is required. `formed`: the creator of every group
    formed and not yet released."""
    where = dict(group=args.group, rank=args.rank)
    if config.require_group_key and not group_key:
        raise PermissionDeniedError(
            "this daemon admits to forming groups only joins that carry a group key (require_group_key): "
            "pass connect(group_key=...) or set NODECOMM_GROUP_KEY, the same on every rank",
            **where,
        )
    formed = list(formed)
    starting = [f.creator for f in forming if f.arrivals]
    groups = len(formed) + len(starting)
    if groups >= config.max_groups:
        raise ResourceExhaustedError(
            f"this daemon holds {groups} groups, its max_groups; a new one can form once one is released", **where
        )
    mine = starting.count(caller)
    if mine >= config.max_forming_groups_per_caller:
        raise ResourceExhaustedError(
            f"{caller} already started {mine} groups that are still forming, this daemon's "
            "max_forming_groups_per_caller; one more can start once one forms or times out",
            **where,
        )
    held = mine + formed.count(caller)
    if held >= config.max_groups_per_caller:
        raise ResourceExhaustedError(
            f"{caller} holds {held} groups formed or forming, this daemon's max_groups_per_caller; one more can "
            "start once one of them is released",
            **where,
        )


def check_admission(forming: FormingGroup, args: JoinArgs, key_digest: bytes) -> None:
    """A later Join to a forming group: refused, before it can change anything there, unless it
    carries the group's key."""
    if not hmac.compare_digest(forming.key_digest, key_digest):
        raise PermissionDeniedError(
            "this Join's group key is not the one the group's first Join carried (or one of them carried "
            "none); every rank must pass the same connect(group_key=...) or NODECOMM_GROUP_KEY",
            group=args.group,
            rank=args.rank,
        )


def join_timeout(joins: Rendezvous, rank: int, timeout: float, cap: str = "") -> str:
    """Why `rank`'s Join waited `timeout` seconds in vain: who is there, who came and gave up (its
    own deadline, or its process went away), and who never came; `cap`: why it waited no longer."""
    there, gave_up = sorted(joins.arrivals), sorted(joins.gave_up)
    never = sorted(set(range(joins.world_size)) - set(there) - set(gave_up))
    parts = [f"rank {rank} waited {timeout:.1f} s{f' ({cap})' if cap else ''}: ranks {there} joined"]
    if gave_up:
        parts.append(f"ranks {gave_up} joined but gave up before the others came")
    if never:
        parts.append(f"ranks {never} never joined")
    return "; ".join(parts) + "; nothing was allocated"


def join_mismatch(
    config: DaemonConfig, forming: FormingGroup, args: JoinArgs, disagreement: tuple[str, str] | None
) -> GroupMismatchError | None:
    """Why `args` cannot join the others: an agreed field that differs (`disagreement`, from
    the Rendezvous, which then did not add it), or a GPU another rank uses."""
    if disagreement is not None:
        name, each = disagreement
        return GroupMismatchError(f"ranks disagree on {name}: {each}; nothing was allocated", group=args.group)
    if args.device_kind == DeviceKind.CUDA and not config.allow_shared_devices:
        for rank, joined in forming.arrivals.items():
            if rank != args.rank and joined.device == args.device:
                return GroupMismatchError(
                    f"ranks {min(rank, args.rank)} and {max(rank, args.rank)} both use {args.device}; "
                    "each rank of a CUDA group needs its own GPU (allow_shared_devices lifts this for "
                    "single-GPU development); nothing was allocated",
                    group=args.group,
                )
    return None


def join_replies(
    config: DaemonConfig, group: Group, tokens: dict[int, bytes], max_blocks: int
) -> dict[int, pb.JoinReply]:
    """What every rank of a group that just formed is answered with: its claim token, the group's
    memory, table and timing settings, and its rank secret."""
    memory, handles = group.memory, group.memory.ipc_handles
    replies = {}
    for rank in range(group.args.world_size):
        reply = replies[rank] = pb.JoinReply(
            group_id=group.group_id,
            claim_token=tokens[rank],
            descriptor_socket=config.descriptor_socket,
            memory_kind=memory.memory_kind,
            control=pb.Segment(owner_rank=-1, size_bytes=memory.control_bytes),
            thresholds=group.table.to_proto(),
            timing_sample_period=config.timing_sample_period,
            operation_timeout_seconds=config.operation_timeout_seconds,
            max_blocks=max_blocks,
            table_switch_period=config.table_switch_period,
            explore_period=config.explore_period if config.live_recalibration else 0,
            rank_secret=group.members[rank].secret,
            service_ordering=group.service_ordering,
            captured_abort=CAPTURED_ABORT_POLICIES[config.captured_abort],
            adoption=group.ticket,
        )
        for owner in range(group.args.world_size):
            reply.buffers.add(
                owner_rank=owner, size_bytes=memory.buffer_bytes, ipc_handle=handles[owner] if handles else b""
            )
    return replies


def retried(forming: FormingGroup, rank: int, join_timeout_seconds: float) -> None:
    """A rank's Join to a group whose forming failed: None, the forming group to replace, where it
    starts a new attempt (it was told of the failure already, or the failure is older than a join
    timeout); else the failure, raised for it too."""
    if rank in forming.failed_ranks or forming.failed_before(join_timeout_seconds):
        return None
    forming.failed_ranks.add(rank)
    raise forming.failure
