"""What makes a Join well formed, whoever checks it: a rank's connect() before it dials a daemon
(client/group_spec.py), and the daemon for every Join it gets (service/groups/join_args.py), which adds
only what it alone knows (its limits, its GPUs, the boundary names of its tables, the pid)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from nodecomm import _native
from nodecomm.capabilities import CAPABILITIES, DeviceKind, shown_sizes
from nodecomm.errors import InvalidArgumentError, shown
from nodecomm.v1 import control_pb2 as pb

GROUP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
DTYPE_NAMES = {v: pb.DType.Name(v).lower() for v in pb.DType.values() if v}
MAX_WORLD_SIZE = _native.MAX_RANKS
MIN_CAPACITY_BYTES = 64


def check_join(
    group: str,
    rank: int,
    world_size: int,
    device_kind: str,
    capacity_bytes: int,
    dtypes: Sequence[int],
    wire: int,
    nccl_fallback: bool,
) -> None:
    """InvalidArgumentError, located at (group, rank), naming the first field that is wrong."""
    where = dict(group=group or None, rank=rank)
    if not GROUP_NAME.fullmatch(group):
        raise InvalidArgumentError(
            f"group name {group[:160]!r}: expected 1-128 characters from [A-Za-z0-9._:/-], starting with a letter "
            "or digit",
        )
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise InvalidArgumentError(f"world_size {world_size}: expected 1..{MAX_WORLD_SIZE}", **where)
    capabilities = CAPABILITIES.get(device_kind)  # none: a kind this build lacks, which the device check refuses
    if capabilities is not None and world_size not in capabilities.world_sizes:
        raise InvalidArgumentError(
            f"world_size {world_size}: a {device_kind.upper()} group takes {shown_sizes(capabilities.world_sizes)} "
            "ranks (the sizes its kernels are built for)",
            **where,
        )
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(f"rank {rank}: expected 0..{world_size - 1} for world_size {world_size}", **where)
    if device_kind == DeviceKind.CPU and nccl_fallback:
        raise InvalidArgumentError("nccl_fallback applies to CUDA groups; a CPU group has no NCCL path", **where)
    if capacity_bytes < MIN_CAPACITY_BYTES:
        raise InvalidArgumentError(
            f"geometry.capacity_bytes {capacity_bytes}: expected at least {MIN_CAPACITY_BYTES}", **where
        )
    if not dtypes or any(d not in DTYPE_NAMES for d in dtypes):
        raise InvalidArgumentError(
            f"geometry.dtypes {shown(list(dtypes))}: expected one or more of {sorted(DTYPE_NAMES.values())}", **where
        )
    if wire not in pb.Wire.values():
        raise InvalidArgumentError(f"geometry.wire {wire}: expected lossless, int8 or fp8", **where)
