"""nodecomm.connect: join a group through the node's daemon and map its buffers."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Mapping

import grpc
import torch

from nodecomm import _native
from nodecomm.captured_abort import policy_in_force
from nodecomm.credentials import rank_metadata
from nodecomm.daemon_channel import open_channel
from nodecomm.errors import (
    DaemonUnavailableError,
    InvalidArgumentError,
    NoDaemonError,
    NodecommError,
    PeerLostError,
    from_rpc_error,
)
from nodecomm.socket_path import descriptor_socket_path
from nodecomm.thresholds import DispatchTable, Path
from nodecomm.v1 import control_pb2 as pb
from nodecomm.v1 import control_pb2_grpc as pb_grpc

from . import daemon_choice, peer_liveness
from .communicator import Communicator
from .cuda_transport import CudaTransport
from .descriptors import DescriptorSocket
from .dtypes import DTYPE_NAMES
from .group_spec import DEFAULT_CAPACITY_BYTES, DEFAULT_DTYPES, GroupSpec
from .host_transport import HostTransport
from .mapping import SegmentMapping, map_descriptors
from .membership import Membership
from .transport import Transport

log = logging.getLogger("nodecomm.client")

# The self-test's all-reduces are 4 KB: a peer path that does not finish them in this long is broken.
SELF_TEST_TIMEOUT_SECONDS = 5.0


def _descriptor_socket_path(target: str, announced: str) -> str:
    """Beside the Unix socket dialled (the daemon's one rule, which holds wherever the directory is
    mounted); over TCP, where the daemon says (a client on the daemon's machine)."""
    return descriptor_socket_path(target.removeprefix("unix:")) if target.startswith("unix:") else announced


def _check_peers(
    stub: pb_grpc.ControlStub,
    transport: CudaTransport,
    group: str,
    group_id: int,
    timeout: float,
    where: dict,
    metadata: tuple[tuple[str, bytes], ...],
) -> pb.ThresholdTable:
    """Prove the group's peer memory works before using it (a map plus write/read-back per
    directed pair, then one exact all-reduce per peer path); every rank reports each stage and
    gets the group's verdict. A failed check leaves only the NCCL path. Returns the table to use."""
    verdict = None
    for stage, check in (
        (1, lambda: transport.probe_peers(group_id, timeout)),
        (2, lambda: transport.self_test(SELF_TEST_TIMEOUT_SECONDS)),
    ):
        detail = check()
        report = pb.PeerCheckReport(
            group=group, group_id=group_id, rank=transport.rank, ok=not detail, detail=detail, stage=stage
        )
        try:
            verdict = stub.CheckPeers(report, timeout=timeout + 5.0, metadata=metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error, **where) from None
        if not verdict.peer_memory_ok:
            log.warning("peer memory unusable; only NCCL carries this group", extra={**where, "reason": verdict.reason})
            transport.drop_peer_paths()
            break
    return verdict.thresholds


def connect(
    group: str,
    rank: int,
    world_size: int,
    device: str | torch.device = "cpu",
    socket: str | None = None,
    timeout: float = 60.0,
    nccl_group: object | None = None,
    *,
    capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
    dtypes: Iterable[str | torch.dtype] = DEFAULT_DTYPES,
    thresholds: Mapping[str, str | int | None] | None = None,
    nccl_by_caller: bool = False,
    table_switching: bool = True,
    daemon: str | None = None,
    job: str | None = None,
    group_key: str | bytes | None = None,
    wire: str = "lossless",
    operation_timeout: float | None = None,
    peer_processes: Mapping[int, tuple[int, int]] | None = None,
) -> Communicator:
    """Join `group` as `rank` of `world_size` and return a ready Communicator.

    Blocks until every rank has joined (at most `timeout` seconds). All ranks must pass the same
    world_size, device kind, capacity_bytes (staging bytes per slot; larger payloads are chunked),
    dtypes and whether they pass an nccl_group, or every rank gets GroupMismatchError naming the
    field. device: "cpu", or "cuda:N" for a GPU group (each rank on its own GPU). nccl_group: the
    engine's torch.distributed NCCL group over the same ranks; sizes no custom path wins go to it.
    `socket` defaults to $NODECOMM_SOCKET or the daemon's default path. thresholds: this group's
    own boundary overrides, e.g. {"dma_min_bytes": "24MiB", "oneshot_max_bytes": "off"}, which win
    over the daemon's; every rank must pass the same. nccl_by_caller: the caller runs its own
    NCCL for the sizes the table gives NCCL (an engine's custom all-reduce slot): the table keeps
    its NCCL ranges, `comm.accepts()` is False for them, and all_reduce refuses them; instead of
    an nccl_group. table_switching: False keeps the table this group formed with (no
    switch to a live one every table_switch_period-th all-reduce, and no exploration).
    daemon: "node" (the default, or $NODECOMM_DAEMON), "private" or "auto" (client/daemon_choice.py):
    a private daemon is the job's own, found by `job` (default: the group name), started by the
    first rank to claim it; `socket` is then where it listens (private) or the node daemon to try
    first (auto). `comm.daemon` says which daemon the rank uses. group_key (default
    $NODECOMM_GROUP_KEY): admission to the forming group, the same on every rank: the first Join
    fixes it and the daemon refuses a later Join without it, so another process cannot take a
    rank's place (nodecomm.distributed and the engine integrations make one on their own).
    wire: "lossless" (the default) or a compressed wire ("int8", "fp8") the dispatch table may
    then use from its compressed_min_bytes on (calibrated, or set in `thresholds`); the same on
    every rank. A group that does not ask is never sent compressed (docs/compressed-wires.md).
    operation_timeout: the most seconds any wait of this rank's collectives lasts (default: the
    daemon's operation_timeout_seconds); the torch backend passes its process group's timeout.
    peer_processes: other ranks' processes on this machine, rank -> (pid, start time) as
    client.peer_liveness.this_process() gives them there: a join that waits on a rank whose process
    has ended fails at once with PeerLostError, not at the timeout (the torch backend passes them).
    """
    spec = GroupSpec.parse(
        group, rank, world_size, device, timeout=timeout, nccl_group=nccl_group, capacity_bytes=capacity_bytes,
        dtypes=dtypes, thresholds=thresholds, nccl_by_caller=nccl_by_caller, table_switching=table_switching,
        group_key=group_key, wire=wire, operation_timeout=operation_timeout,
    )  # fmt: skip
    where = spec.where
    processes = _checked_processes(peer_processes, rank, world_size, where)
    # node by default: an engine that builds its own groups runs where nodecommd is deployed, and an
    # unreachable node daemon should fail its connect, not hide behind a job's own daemon.
    mode = daemon_choice.resolve_mode(daemon, daemon_choice.DaemonMode.NODE, where)
    chosen, lease = daemon_choice.choose(mode, socket, job or group, timeout, where)
    try:
        communicator = _join(spec, chosen, lease, nccl_group, processes)
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    communicator._start(timeout)
    return communicator


def _checked_processes(
    peer_processes: Mapping[int, tuple[int, int]] | None, rank: int, world_size: int, where: dict
) -> dict[int, tuple[int, int]]:
    checked = {}
    for peer, process in (peer_processes or {}).items():
        pair = tuple(process) if isinstance(process, (tuple, list)) else ()
        if (
            isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < world_size or peer == rank
            or len(pair) != 2 or not all(isinstance(v, int) and v > 0 for v in pair)
        ):  # fmt: skip
            raise InvalidArgumentError(
                f"peer_processes {{{peer!r}: {process!r}}}: expected another rank of 0..{world_size - 1} mapped to "
                "its (pid, start time), as peer_liveness.this_process() gives them",
                **where,
            )
        checked[peer] = (pair[0], pair[1])
    return checked


# How often a Join that waits looks after the peers' processes.
_PEER_WATCH_SECONDS = 0.2


def _joined(join: grpc.Future, peer_processes: dict[int, tuple[int, int]], where: dict) -> pb.JoinReply:
    """The Join's reply; PeerLostError (the Join cancelled) as soon as a peer's process has ended."""
    while True:
        try:
            return join.result(timeout=_PEER_WATCH_SECONDS if peer_processes else None)
        except grpc.FutureTimeoutError:
            gone = sorted(
                rank for rank, process in peer_processes.items() if not peer_liveness.process_running(process)
            )
            if gone and join.cancel():  # not cancelled: the reply came meanwhile, taken above
                pids = ", ".join(str(peer_processes[rank][0]) for rank in gone)
                raise PeerLostError(
                    f"ranks {gone} ended (pid {pids}) before the group formed: this Join waits for them no longer",
                    **where,
                ) from None


def _join(
    spec: GroupSpec,
    chosen: daemon_choice.DaemonChoice,
    lease: daemon_choice.JobLeaseHandle | None,
    nccl_group: object | None,
    peer_processes: dict[int, tuple[int, int]],
) -> Communicator:
    """Join through the chosen daemon, claim and map the buffers: a Communicator not yet started."""
    group, rank, world_size, where = spec.group, spec.rank, spec.world_size, spec.where
    device_index, capacity_bytes, timeout = spec.device_index, spec.capacity_bytes, spec.timeout
    # Only a daemon that proved who it is (nodecomm.daemon_channel) gets this rank's data.
    try:
        channel, target = open_channel(chosen.socket, chosen.daemon_uids, timeout, [("grpc.enable_retries", 0)])
    except DaemonUnavailableError as error:
        if chosen.kind is daemon_choice.DaemonMode.NODE and isinstance(error, NoDaemonError):
            raise NoDaemonError(
                f"{error.detail}: start nodecommd there, set {daemon_choice.ENVIRONMENT_SOCKET} to the socket of "
                f"one that runs, or pass daemon='auto' ({daemon_choice.ENVIRONMENT_VARIABLE}=auto) for a daemon "
                "private to the job where no node daemon answers",
                **where,
            ) from None
        raise error.located(**where) from None
    except NodecommError as error:
        raise error.located(**where) from None
    # Binds the Join to this process's pid (the daemon reads its uid from the connection), and a
    # daemon that does not admit this uid says so here, in its own words.
    identity = b""
    if target.startswith("unix:"):
        try:
            identity = DescriptorSocket(_descriptor_socket_path(target, ""), chosen.daemon_uids).identify(
                timeout, where
            )
        except BaseException:
            channel.close()
            raise
    stub = pb_grpc.ControlStub(channel)
    request = spec.join_request(identity)
    try:
        reply = _joined(stub.Join.future(request, timeout=timeout + 5.0, wait_for_ready=False), peer_processes, where)
    except grpc.RpcError as error:
        channel.close()
        raise from_rpc_error(error, **where) from None
    except BaseException:
        channel.close()
        raise

    expected_kinds = (pb.HOST_MEMFD,) if device_index is None else (pb.CUDA_VMM_FD, pb.CUDA_IPC_LEGACY)
    control: SegmentMapping | None = None
    control_fd = -1
    buffers: list[SegmentMapping] = []
    transport: Transport | None = None
    try:
        if reply.memory_kind not in expected_kinds:
            raise DaemonUnavailableError(
                f"the daemon offers {pb.MemoryKind.Name(reply.memory_kind)} memory; this client maps "
                f"{' or '.join(pb.MemoryKind.Name(k) for k in expected_kinds)}",
                **where,
            )
        legacy = reply.memory_kind == pb.CUDA_IPC_LEGACY
        sizes = [reply.control.size_bytes, *(b.size_bytes for b in reply.buffers)]
        # The kernels address every rank's buffer by this client's layout: a daemon of another
        # version may lay out less, which peers' writes would overrun.
        needed = (_native.shm_buffer_bytes if device_index is None else _native.cuda_buffer_bytes)(capacity_bytes)
        if any(size < needed for size in sizes[1:]):
            raise DaemonUnavailableError(
                f"the daemon's buffers ({', '.join(str(s) for s in sizes[1:])} bytes) are smaller than the "
                f"{needed} bytes this client lays out for {capacity_bytes}-byte slots: the daemon and the "
                "client are different versions of nodecomm",
                **where,
            )
        descriptor_socket = DescriptorSocket(
            _descriptor_socket_path(target, reply.descriptor_socket), chosen.daemon_uids
        )
        # Legacy buffers come as handles in the reply: only the control page crosses as a descriptor.
        fds = descriptor_socket.claim(reply.claim_token, 1 if legacy else len(sizes), timeout, where)
        try:
            control = SegmentMapping.from_descriptor(fds[0], sizes[0], None, where)
            control_fd = os.dup(fds[0])  # handed to the next daemon if this one goes (Communicator._reattach)
            if legacy:
                for segment in reply.buffers:
                    buffers.append(SegmentMapping.from_ipc_handle(segment.ipc_handle, segment.size_bytes, device_index))
            else:
                buffers = map_descriptors(fds[1:], sizes[1:], device_index, where)
        finally:
            for fd in fds:
                os.close(fd)  # the mappings keep the memory
        table = reply.thresholds
        switch_period = reply.table_switch_period if spec.table_switching else 0
        # A group that keeps its table could never take what exploring finds: it does not pay for it
        # (every explore_period-th call on a rival path and timed, since its rivals never settle).
        explore_period = reply.explore_period if switch_period else 0
        if device_index is None:
            transport = HostTransport(rank, world_size, buffers, control, capacity_bytes)
        else:
            transport = CudaTransport(
                rank, world_size, device_index, buffers, control, capacity_bytes, reply.max_blocks, nccl_group
            )
            table = _check_peers(
                stub, transport, group, reply.group_id, timeout, where, rank_metadata(reply.rank_secret)
            )
            if Path.ONESHOT not in transport.paths:
                # NCCL alone: one range, nothing to explore, and no peer memory to agree on a table over.
                switch_period = explore_period = 0
        communicator = Communicator(
            membership=Membership(group, reply.group_id, rank, world_size),
            channel=channel,
            control=control,
            descriptor_socket=descriptor_socket,
            transport=transport,
            dtypes=frozenset(DTYPE_NAMES[pb.DType.Name(c).lower()] for c in spec.dtypes),
            table=DispatchTable.from_proto(table),
            timing_sample_period=reply.timing_sample_period,
            operation_timeout=spec.operation_timeout or reply.operation_timeout_seconds,
            table_switch_period=switch_period,
            explore_period=explore_period,
            rank_secret=reply.rank_secret,
            daemon=chosen,
            daemon_lease=lease,
            service_ordering=reply.service_ordering,
            captured_abort=policy_in_force(reply.captured_abort, spec.captured_abort),
            control_fd=control_fd,
            ticket=reply.adoption,
        )
        control_fd = -1  # the communicator's now
    except BaseException:
        if control_fd >= 0:
            os.close(control_fd)
        if transport is not None:
            transport.close()
        else:
            for mapping in buffers:
                mapping.unmap()
        if control is not None:
            control.unmap()
        # The group formed with this rank in it: its peers hear now, not after the session grace.
        with contextlib.suppress(grpc.RpcError):
            stub.Leave(
                pb.LeaveRequest(group=group, group_id=reply.group_id, rank=rank),
                timeout=5.0,
                metadata=rank_metadata(reply.rank_secret),
            )
        channel.close()
        raise
    return communicator
