"""nodecomm as a torch.distributed backend: importing this module registers "nodecomm", a C++
c10d::Backend (nodecomm._c10d) over a Python group of each process group's operations
(process_group.NodecommProcessGroup), for CPU and CUDA alike, mixable with other backends per
device type ("cpu:gloo,cuda:nodecomm").

    import torch.distributed as dist, nodecomm.distributed
    dist.init_process_group("nodecomm")          # under torchrun; CPU and CUDA tensors
    dist.all_reduce(x)                           # SUM of float32/16/bf16: comm.all_reduce's bits
    comm = nodecomm.distributed.communicator()   # the Communicator behind the default group

Every process group becomes its own nodecomm groups, named from a token that the group's rank 0
draws and shares through the group's c10d store (so two jobs on one node never collide) and the
group's name. The daemon is the node's ($NODECOMM_SOCKET or the default path, or
`Options(socket=...)` passed as `pg_options`) when it answers, else one private to the job that
its ranks start and that leaves with them (`Options(daemon=...)`, $NODECOMM_DAEMON: "auto",
"node", "private").

A group whose ranks sit on several nodes (torchrun's LOCAL_WORLD_SIZE below WORLD_SIZE; here: ranks
whose host or daemon socket differ) runs across nodes: each node's ranks through that node's
daemon, the nodes through gloo (CPU tensors) or NCCL (CUDA) groups built on the group's store
(nodecomm.client.hierarchical).
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import secrets
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from nodecomm.client import c10d_module, daemon_choice, peer_liveness
from nodecomm.client.daemon_choice import DaemonMode
from nodecomm.client.hierarchical import node_name
from nodecomm.errors import DeadlineExceededError, GroupMismatchError, InvalidArgumentError, shown

from .process_group import NodecommProcessGroup

# After torch (imported above): the module names torch's libraries, which `import torch` loads.
_c10d = c10d_module()

log = logging.getLogger("nodecomm.distributed")

__all__ = ["BACKEND_NAME", "NodecommProcessGroup", "Options", "communicator", "daemon"]

BACKEND_NAME = "nodecomm"


@dataclass(frozen=True)
class Options:
    """What `dist.init_process_group("nodecomm", pg_options=Options(...))` and `dist.new_group(...,
    pg_options=...)` pass on to `nodecomm.connect` for the group's nodecomm groups."""

    socket: str | None = None
    capacity_bytes: int | None = None
    thresholds: dict[str, str | int | None] = field(default_factory=dict)
    # "auto" (None: $NODECOMM_DAEMON, else auto), "node" or "private": see client/daemon_choice.py.
    daemon: str | None = None

    def connect_options(self) -> dict[str, object]:
        options: dict[str, object] = {}
        if self.capacity_bytes is not None:
            options["capacity_bytes"] = self.capacity_bytes
        if self.thresholds:
            options["thresholds"] = dict(self.thresholds)
        return options


# How many process groups of each name this process has created: a group destroyed and created
# again under the same name (torch reuses names after destroy_process_group) draws a new token.
_creations: collections.Counter[str] = collections.Counter()
# Groups still open at exit leave their nodecomm groups (peers hear a Leave, not a lost session).
_open_groups: weakref.WeakSet[NodecommProcessGroup] = weakref.WeakSet()


@atexit.register
def _leave_at_exit() -> None:
    for group in list(_open_groups):
        group.shutdown()


# The job's key for a private daemon: the first process group's token this process saw, which every
# process of the job shares when that group is the default one (a group of some ranks only may
# name another; its members still all use the daemon its rank 0 names).
_job_token: str | None = None


def _node_names(
    store: dist.Store, rank: int, size: int, generation: int, timeout: timedelta, options: Options
) -> tuple[list[str], list[tuple[str, int, int]]]:
    """Every rank's node name (its host and its node daemon's socket) and process (its machine's
    boot and pid namespace, its pid and start time: a join waits no longer for a rank whose
    process has ended), through the store."""
    keys = [f"nodecomm/node/{generation}/{r}" for r in range(size)]
    process = peer_liveness.this_process() or (0, 0)
    # Pids mean the same process only on one machine and in one pid namespace.
    place = f"{peer_liveness.this_machine()} {peer_liveness.pid_namespace()}"
    store.set(keys[rank], json.dumps([node_name(options.socket), place, *process]))
    try:
        store.wait(keys, timeout)
    except Exception as error:  # noqa: BLE001 (torch raises DistStoreError, a RuntimeError)
        raise DeadlineExceededError(f"not every rank of {size} came within {timeout}: {error}") from None
    entries = [_node_entry(key, store.get(key)) for key in keys]
    return [name for name, *_ in entries], [(place, pid, start) for _, place, pid, start in entries]


def _node_entry(key: str, raw: bytes) -> tuple[str, str, int, int]:
    """A rank's entry as _node_names writes it: whoever can write the job's store can write
    anything there, and what is not that stops the rank, named."""
    try:
        name, place, pid, start = json.loads(raw)
        if not (isinstance(name, str) and isinstance(place, str)):
            raise ValueError("not two strings first")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in (pid, start)):
            raise ValueError("not two whole numbers after them")
    except (ValueError, TypeError) as error:
        raise GroupMismatchError(
            f"the job's c10d store holds {shown(raw.decode(errors='replace'))} at {key!r}, not what a rank of "
            f"nodecomm writes there ([node name, machine, pid, start time]: {error}); another program wrote the store"
        ) from None
    return name, place, pid, start


def _shared_daemon(
    store: dist.Store, rank: int, generation: int, timeout: timedelta, options: Options, names: list[str]
) -> tuple[str, str, daemon_choice.DaemonChoice, daemon_choice.JobLeaseHandle | None]:
    """The group's token and group key, drawn by its rank 0 and shared through the store (the key
    admits the job's ranks, and no other process, to the nodecomm groups), and the daemon, which
    every rank resolves itself: whoever can write the store can write anything there, so nothing
    read from it is dialled. Rank 0 announces the daemon it resolved, and another rank that
    resolved a different one stops with both named. A private daemon is started by the first rank
    to claim it, and this process holds a lease on it. Across nodes (`names` differ) each rank
    takes its own node's daemon, a private one per node."""
    global _job_token
    entry = f"nodecomm/group/{generation}"
    mode = daemon_choice.resolve_mode(options.daemon, DaemonMode.AUTO, {})
    across = len(set(names)) > 1
    if rank == 0:
        token, group_key = secrets.token_hex(6), secrets.token_hex(16)
        _job_token = _job_token or token
        resolved = daemon_choice.decide(mode, options.socket, _job_token) if not across else None
        store.set(entry, f"{token} {group_key} {_announcement(resolved)}")
    else:
        try:
            store.wait([entry], timeout)
        except Exception as error:  # noqa: BLE001 (torch raises DistStoreError, a RuntimeError)
            raise DeadlineExceededError(f"rank 0 did not announce the group within {timeout}: {error}") from None
        fields = store.get(entry).decode(errors="replace").split(" ", 2)
        if len(fields) != 3:
            raise GroupMismatchError(
                f"the job's c10d store holds {shown(' '.join(fields))} where rank 0 announces the group "
                "('<token> <group key> <daemon kind> <socket>'): another program wrote the store",
                rank=rank,
            )
        token, group_key, announced = fields
        _job_token = _job_token or token
        resolved = daemon_choice.decide(mode, options.socket, _job_token) if not across else None
        if announced != _announcement(resolved):
            raise GroupMismatchError(
                f"rank 0 announced the daemon {announced!r} in the job's c10d store, but this rank resolved "
                f"{_announcement(resolved)!r}: every rank of a job must resolve the same daemon (the same "
                "NODECOMM_DAEMON, NODECOMM_SOCKET and XDG_RUNTIME_DIR, or Options), or someone else wrote the "
                "store; this rank dials no daemon it did not resolve itself",
                rank=rank,
            )
    if across:
        node = names[rank]
        resolved = daemon_choice.decide(mode, options.socket, f"{_job_token}.{names.index(node)}")
    kind, socket = resolved
    if kind is DaemonMode.NODE:
        return token, group_key, daemon_choice.DaemonChoice(DaemonMode.NODE, socket), None
    choice, lease = daemon_choice.attach_private(socket, timeout.total_seconds(), {"rank": rank})
    return token, group_key, choice, lease


def _announcement(resolved: tuple[DaemonMode, str] | None) -> str:
    """How a resolved daemon (kind and socket) is written in the store; "- -" across nodes."""
    return "- -" if resolved is None else f"{resolved[0]} {resolved[1]}"


def _create(backend_options: dist.distributed_c10d._DistributedBackendOptions, pg_options) -> _c10d.Backend:
    """torch's creator for one device type's backend (or both, where the backend string names only
    "nodecomm"): the C++ backend over a Python group of its own."""
    options = pg_options if pg_options is not None else Options()
    if not isinstance(options, Options):
        raise InvalidArgumentError(f"pg_options: expected nodecomm.distributed.Options, got {type(options).__name__}")
    group_name = str(backend_options.group_id)
    _creations[group_name] += 1
    rank, size, timeout = backend_options.group_rank, backend_options.group_size, backend_options.timeout
    names, processes = _node_names(backend_options.store, rank, size, _creations[group_name], timeout, options)
    token, group_key, daemon, lease = _shared_daemon(
        backend_options.store, rank, _creations[group_name], timeout, options, names
    )
    log.info(f"process group {group_name!r} uses {daemon}", extra={"rank": rank, "socket": daemon.socket})
    safe_name = "".join(c if c.isalnum() or c in "._-" else "_" for c in group_name)[:48]
    group = NodecommProcessGroup(
        backend_options.store,
        rank,
        size,
        name=f"torch.{token}.{safe_name}",
        timeout=timeout,
        connect_options={
            **options.connect_options(),
            "socket": daemon.socket,
            "daemon": daemon.kind,
            "group_key": group_key,
        },
        daemon=daemon,
        daemon_lease=lease,
        node_names=names if len(set(names)) > 1 else None,
        global_ranks=list(backend_options.global_ranks_in_group) or list(range(size)),
        processes=processes,
    )
    _open_groups.add(group)
    return _c10d.Backend(group, rank, size, timeout)


def _composed(group: dist.ProcessGroup | None, device: torch.device) -> NodecommProcessGroup:
    """The Python group behind `group`'s nodecomm backend for `device`'s type."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        backend = group._get_backend(device)
    except RuntimeError:  # no backend for that device type
        backend = None
    if not isinstance(backend, _c10d.Backend):
        raise InvalidArgumentError(
            f"expected a process group whose {device.type} backend is {BACKEND_NAME!r}, got {group!r}"
        )
    return backend.composed


def communicator(group: dist.ProcessGroup | None = None, device: str | torch.device = "cpu"):
    """The Communicator behind a "nodecomm" process group (the default group when None) for
    `device` ("cpu", "cuda" or "cuda:N"): for the calls torch has no name for (top-k exchange,
    service buffers, the dispatch table). Collective the first time for a device: every rank of
    the group joins its nodecomm group then."""
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return _composed(group, resolved).node_group(resolved.type).communicator(resolved)


def daemon(group: dist.ProcessGroup | None = None, device: str | torch.device = "cpu") -> daemon_choice.DaemonChoice:
    """Which daemon a "nodecomm" process group (the default group when None) uses for `device`'s
    type: the node's or the job's own, as the group's rank 0 chose."""
    return _composed(group, torch.device(device)).daemon


dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
