"""nodecomm.connect: join a group through the node's daemon and map its buffers."""

from __future__ import annotations

import os
from collections.abc import Iterable

import grpc
import torch

from nodecomm import host_memory
from nodecomm.errors import DaemonUnavailableError, InvalidArgumentError, PermissionDeniedError, from_rpc_error
from nodecomm.socket_path import default_socket_path, grpc_target
from nodecomm.thresholds import DispatchTable
from nodecomm.v1 import control_pb2 as pb
from nodecomm.v1 import control_pb2_grpc as pb_grpc

from .communicator import DTYPE_CODES, DTYPE_NAMES, Communicator, SegmentMapping
from .descriptors import claim_descriptors

DEFAULT_CAPACITY_BYTES = 8 << 20
DEFAULT_DTYPES = ("float32", "float16", "bfloat16")


def _descriptor_socket_path(socket: str, announced: str) -> str:
    """The daemon names its descriptor socket by its own path; a container that mounts the socket
    directory elsewhere finds it beside the control socket it dialled."""
    if os.path.exists(announced) or socket.startswith(("ipv4:", "ipv6:", "dns:", "unix-abstract:")):
        return announced
    directory = os.path.dirname(socket.removeprefix("unix:"))
    return os.path.join(directory, os.path.basename(announced))


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
) -> Communicator:
    """Join `group` as `rank` of `world_size` and return a ready Communicator.

    Blocks until every rank has joined (at most `timeout` seconds). All ranks must pass the same
    world_size, device kind, capacity_bytes (staging bytes per slot; larger payloads are chunked)
    and dtypes, or every rank gets GroupMismatchError naming the field. `socket` defaults to
    $NODECOMM_SOCKET or the daemon's default path.
    """
    where = dict(group=group, rank=rank)
    device_name = str(device)
    if device_name != "cpu":
        raise InvalidArgumentError(f"device {device_name!r}: only 'cpu' groups are supported by this build", **where)
    if nccl_group is not None:
        raise InvalidArgumentError("nccl_group applies to CUDA groups; a CPU group has no NCCL path", **where)
    if not timeout > 0:
        raise InvalidArgumentError(f"timeout {timeout!r}: expected a positive number of seconds", **where)
    dtype_codes = []
    for dtype in dtypes:
        resolved = DTYPE_NAMES.get(dtype) if isinstance(dtype, str) else dtype
        if resolved not in DTYPE_CODES:
            raise InvalidArgumentError(f"dtype {dtype!r}: expected one of {list(DTYPE_NAMES)}", **where)
        dtype_codes.append(DTYPE_CODES[resolved])

    socket = socket or default_socket_path()
    channel = grpc.insecure_channel(grpc_target(socket), options=[("grpc.enable_retries", 0)])
    stub = pb_grpc.ControlStub(channel)
    request = pb.JoinRequest(
        group=group,
        rank=rank,
        world_size=world_size,
        device=device_name,
        geometry=pb.Geometry(capacity_bytes=capacity_bytes, dtypes=dtype_codes),
        pid=os.getpid(),
        join_timeout_seconds=timeout,
    )
    try:
        reply: pb.JoinReply = stub.Join(request, timeout=timeout + 5.0, wait_for_ready=False)
    except grpc.RpcError as error:
        channel.close()
        raise from_rpc_error(error, **where) from None

    mappings: list[SegmentMapping] = []
    try:
        sizes = [reply.control.size_bytes, *(b.size_bytes for b in reply.buffers)]
        descriptor_socket = _descriptor_socket_path(socket, reply.descriptor_socket)
        try:
            fds = claim_descriptors(descriptor_socket, reply.claim_token, len(sizes), timeout)
        except PermissionError as error:
            raise PermissionDeniedError(f"descriptor claim refused: {error}", **where) from None
        except OSError as error:
            raise DaemonUnavailableError(f"descriptor socket {descriptor_socket}: {error}", **where) from None
        try:
            if len(fds) != len(sizes):
                raise DaemonUnavailableError(f"expected {len(sizes)} descriptors, received {len(fds)}", **where)
            for fd, size in zip(fds, sizes, strict=True):
                if host_memory.segment_size(fd) < size:
                    raise DaemonUnavailableError(
                        f"segment of {host_memory.segment_size(fd)} bytes is smaller than announced {size}", **where
                    )
                mappings.append(SegmentMapping(host_memory.map_segment(fd, size), size))
        finally:
            for fd in fds:
                os.close(fd)  # the mappings keep the memory
        communicator = Communicator(
            group=group,
            rank=rank,
            world_size=world_size,
            group_id=reply.group_id,
            channel=channel,
            control=mappings[0],
            buffers=mappings[1:],
            capacity_bytes=capacity_bytes,
            dtypes=frozenset(DTYPE_NAMES[pb.DType.Name(c).lower()] for c in dtype_codes),
            table=DispatchTable.from_proto(reply.thresholds),
            timing_sample_period=reply.timing_sample_period,
            operation_timeout=reply.operation_timeout_seconds,
        )
    except BaseException:
        for mapping in mappings:
            host_memory.unmap_segment(mapping.address, mapping.size_bytes)
        channel.close()
        raise
    communicator._start(timeout)
    return communicator
