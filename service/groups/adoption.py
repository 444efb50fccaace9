"""Adoption: how a daemon takes over the groups an earlier one formed, which ran on without it.

The daemon that forms a group gives every rank a ticket: the group's record (pb.GroupRecord: its
id, the Join every rank agreed with, each rank's pid, uid and device, its memory) and an HMAC of
the record under the node's adoption key, a secret in the state directory that only the daemon's
uid can read. Each rank's secret is an HMAC of the group's id, a salt and the rank under the same
key. When its session is lost, a rank reconnects with the checks of a first connection
(nodecomm.daemon_channel), hands its control page back on the descriptor socket and calls Adopt
with its ticket and its secret. A daemon holding the same key knows the record for one it (or
its predecessor) wrote and the secret for the rank's, and takes the group over: the control page
gives it the abort word, and each rank's session comes back as after a Join. The buffers stay
where they are, with the ranks (a memfd lives while a process maps it, a CUDA VMM allocation while
a process holds it); a group whose memory the daemon's exit freed (legacy CUDA IPC) was aborted
and is never adopted.

Why the ranks re-register, rather than the old daemon handing its state over (Envoy's hot restart,
HAProxy's seamless reload) or systemd keeping descriptors (FileDescriptorStoreMax=): only the
ranks still hold everything after a SIGKILL or an OOM kill, which leave no old daemon to hand
anything over; a descriptor store serves systemd alone, not a Kubernetes pod replaced by its
DaemonSet; and a rank that re-registers needs no second daemon beside the first on one socket
(no maxSurge). What the daemon must keep across its own death is only the key, in the state
directory that already holds its calibrations.
"""

from __future__ import annotations

import fcntl
import hmac
import logging
import os
import secrets
from collections.abc import Callable

from nodecomm import _native, host_memory, trust
from nodecomm.capabilities import DeviceKind
from nodecomm.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NodecommError,
    NotFoundError,
    PermissionDeniedError,
    UnsupportedError,
)
from nodecomm.service.access.callers import Caller
from nodecomm.service.access.quotas import Quotas
from nodecomm.service.calibration.live_thresholds import LiveEstimates
from nodecomm.service.calibration.tables import TableKeeper
from nodecomm.service.config import DaemonConfig
from nodecomm.service.groups.group import Group, Member
from nodecomm.service.groups.join_args import JoinArgs, validate_join
from nodecomm.service.memory.allocator import GroupMemory
from nodecomm.service.memory.handles import Handback, is_declared_process
from nodecomm.socket_path import ADOPTION_KEY_NAME
from nodecomm.thresholds import DispatchTable, Path
from nodecomm.v1 import control_pb2 as pb

log = logging.getLogger("nodecomm.adoption")

KEY_FILE = ADOPTION_KEY_NAME
KEY_BYTES = 32
SALT_BYTES = 16
# The highest table epoch an adopted group may bring: the daemon's own epochs count on from it.
MAX_ADOPTED_EPOCH = 1 << 62


def load_key(directory: str) -> bytes:
    """The node's adoption key (a job's, for its private daemon), from `directory`/adoption.key (made 0600, with a new key, where
    missing). Where the directory or the file fails the checks a secret needs (this uid's, no one
    else may read or write it), a key of this process's own: its groups still form and run, but
    no later daemon can adopt them (logged)."""
    path = os.path.join(directory, KEY_FILE)
    try:
        os.makedirs(directory, 0o700, exist_ok=True)
        trust.trusted_directory(directory, frozenset({os.geteuid()}), trust.ADOPTION_STAKES)
        with os.fdopen(trust.open_private_file(path), "r+b") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            if mode & 0o077:
                raise PermissionDeniedError(f"{path} has mode {mode & 0o777:o}; expected 600: others could read it")
            fcntl.flock(handle, fcntl.LOCK_EX)  # two daemons starting at once write one key
            key = handle.read()
            if not key:
                key = secrets.token_bytes(KEY_BYTES)
                handle.write(key)
                handle.flush()
                os.fsync(handle.fileno())
            elif len(key) != KEY_BYTES:
                raise PermissionDeniedError(f"{path} holds {len(key)} bytes; expected a {KEY_BYTES}-byte key")
        return key
    except (OSError, NodecommError) as error:
        log.warning(
            f"no adoption key in {directory} ({error}): the groups this daemon forms run on if it stops, "
            "but the next daemon cannot adopt them",
            extra={"path": path},
        )
        return secrets.token_bytes(KEY_BYTES)


def rank_secret(key: bytes, group_id: int, salt: bytes, rank: int) -> bytes:
    """What proves rank `rank` of the group: given at its Join, known again to a daemon with the key."""
    message = b"nodecomm rank secret\0" + group_id.to_bytes(8, "little") + salt + rank.to_bytes(4, "little")
    return hmac.digest(key, message, "sha256")[:16]


def ticket_for(key: bytes, record: pb.GroupRecord) -> pb.AdoptionTicket:
    data = record.SerializeToString(deterministic=True)
    return pb.AdoptionTicket(record=data, tag=_tag(key, data))


def record_of(key: bytes, ticket: pb.AdoptionTicket) -> pb.GroupRecord:
    """The record a ticket carries, where this key made its tag; PermissionDeniedError otherwise
    (another node's daemon, a key since replaced, or a forged ticket)."""
    if not hmac.compare_digest(_tag(key, ticket.record), ticket.tag):
        raise PermissionDeniedError(
            "this group's ticket was not issued under this node's adoption key (another node, a replaced "
            "state directory, or a forged ticket): the group cannot be adopted; close the communicator and "
            "connect again"
        )
    return pb.GroupRecord.FromString(ticket.record)


def _tag(key: bytes, data: bytes) -> bytes:
    return hmac.digest(key, b"nodecomm group record\0" + data, "sha256")


def check_rank_proof(
    key: bytes, record: pb.GroupRecord, rank: int, secret: bytes, caller: Caller, handback: Handback | None, where: dict
) -> None:
    """That the caller holds `rank`'s membership of the group `record` describes (its rank secret,
    its uid) and handed the group's control page back from that rank's process."""
    recorded = record.ranks[rank]
    expected = rank_secret(key, record.group_id, record.salt, rank)
    if not hmac.compare_digest(expected, secret) or caller.uid not in (None, recorded.uid):
        raise PermissionDeniedError(
            f"this caller does not hold rank {rank}'s membership (its rank secret, uid {recorded.uid})",
            **where,
        )
    if handback is None:
        raise InvalidArgumentError(
            "control_token: unknown, used or expired; hand the control page back on the descriptor socket first",
            **where,
        )
    if handback.uid != recorded.uid or not is_declared_process(handback.pid, recorded.pid):
        raise PermissionDeniedError(
            f"the control page was handed back by pid {handback.pid} (uid {handback.uid}), not by rank "
            f"{rank}'s process (pid {recorded.pid}, uid {recorded.uid})",
            **where,
        )


def adopted_group(
    record: pb.GroupRecord, thresholds: pb.ThresholdTable, control_fd: int, ticket: pb.AdoptionTicket, where: dict,
    key: bytes, config: DaemonConfig, gpus: list[str], quotas: Quotas, tables: TableKeeper,
    name_taken: Callable[[Caller, str], bool],
) -> Group:  # fmt: skip
    """The group `record` describes, rebuilt on the control page `control_fd` with the ranks' table
    (`thresholds`): what a daemon adopts, checked against what it can serve."""
    args = JoinArgs.from_request(record.join, record.ranks[0].uid)
    validate_join(args, config, gpus)
    for recorded in record.ranks:
        if recorded.device != DeviceKind.CPU and recorded.device not in gpus:
            raise UnsupportedError(f"this daemon does not see the group's GPU {recorded.device}", **where)
    if record.memory_kind not in (pb.HOST_MEMFD, pb.CUDA_VMM_FD):
        raise UnsupportedError("a group on legacy CUDA IPC buffers dies with its daemon", **where)
    creator = Caller(None if record.creator_is_tcp else record.creator_uid)
    if name_taken(creator, args.group):
        raise AlreadyExistsError("a group of this name formed on this daemon meanwhile", **where)
    try:
        table = DispatchTable.from_proto(thresholds)
    except (ValueError, KeyError) as error:
        raise InvalidArgumentError(f"thresholds: {error}", **where) from None
    if Path.SERVICE in table.range_paths:
        raise UnsupportedError("a group whose table has a service range dies with its daemon", **where)
    if table.epoch > MAX_ADOPTED_EPOCH:
        raise InvalidArgumentError(f"thresholds.epoch {table.epoch}: expected at most {MAX_ADOPTED_EPOCH}", **where)
    page = os.fstat(control_fd)  # its size and seals were checked as it was handed back
    if (page.st_dev, page.st_ino) != (record.control_device, record.control_inode):
        raise PermissionDeniedError("the descriptor handed back is not this group's control page", **where)
    quotas.check_group(args, [m.device for m in record.ranks], creator)
    address = host_memory.map_segment(control_fd, _native.CONTROL_BYTES)
    if _native.abort_state(address)[0] != 0:
        host_memory.unmap_segment(address, _native.CONTROL_BYTES)
        raise NotFoundError("the group was aborted (or its ranks left): it cannot be adopted", **where)
    tables.adopt_epoch(table.epoch)
    memory = GroupMemory(
        record.memory_kind, control_fd, address, [], record.buffer_bytes, adopted_buffers=len(record.ranks)
    )
    return Group(
        name=args.group,
        group_id=record.group_id,
        args=args,
        memory=memory,
        table=table,
        members={
            r: Member(r, pid=m.pid, uid=m.uid, secret=rank_secret(key, record.group_id, record.salt, r))
            for r, m in enumerate(record.ranks)
        },
        devices=[m.device for m in record.ranks],
        creator=creator,
        live=(
            LiveEstimates(args.world_size, config.live_margin, config.live_min_samples)
            if config.live_recalibration
            else None
        ),
        ticket=ticket,
        adopted=True,
    )
