"""GroupSpec: what a rank's connect() asks to join, parsed and checked once, then frozen. The
checks a Join must pass are nodecomm.join_rules', which the daemon runs again on the request; the
Join request is made from the spec."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from nodecomm import _native
from nodecomm.byte_size import parse_byte_size
from nodecomm.capabilities import DeviceKind
from nodecomm.captured_abort import job_policy
from nodecomm.errors import InvalidArgumentError
from nodecomm.join_rules import check_join
from nodecomm.thresholds import Wire
from nodecomm.v1 import control_pb2 as pb

from .dtypes import DTYPE_CODES, DTYPE_NAMES

DEFAULT_CAPACITY_BYTES = 8 << 20
DEFAULT_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class GroupSpec:
    group: str
    rank: int
    world_size: int
    device_id: str  # "cpu", or the GPU's UUID (the daemon knows GPUs by UUID)
    device_index: int | None  # the GPU's CUDA index in this process
    capacity_bytes: int
    dtypes: tuple[int, ...]  # nodecomm.v1.DType codes
    overrides: tuple[tuple[str, int | None], ...]  # this group's own boundaries (None: off)
    wire: Wire
    nccl_fallback: bool  # sizes the table gives NCCL: an nccl_group, or the caller's own NCCL
    nccl_by_caller: bool
    table_switching: bool
    group_key: bytes
    timeout: float  # for joining
    operation_timeout: float | None  # None: the daemon's
    captured_abort: int | None  # the job's NODECOMM_CAPTURED_ABORT (pb.CapturedAbort); None: the daemon's

    @property
    def where(self) -> dict:
        return dict(group=self.group, rank=self.rank)

    @property
    def device_kind(self) -> str:
        return DeviceKind.CPU if self.device_index is None else DeviceKind.CUDA

    @classmethod
    def parse(
        cls,
        group: str,
        rank: int,
        world_size: int,
        device: str | torch.device,
        *,
        timeout: float,
        nccl_group: object | None,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        dtypes: Iterable[str | torch.dtype] = DEFAULT_DTYPES,
        thresholds: Mapping[str, str | int | None] | None = None,
        nccl_by_caller: bool = False,
        table_switching: bool = True,
        group_key: str | bytes | None = None,
        wire: str = "lossless",
        operation_timeout: float | None = None,
    ) -> GroupSpec:
        """connect()'s arguments checked (InvalidArgumentError naming the first that is wrong)."""
        where = dict(group=group, rank=rank)
        if not isinstance(group, str):
            raise InvalidArgumentError(f"group: expected a str, got {type(group).__name__}", rank=rank)
        for name, value in (("rank", rank), ("world_size", world_size), ("capacity_bytes", capacity_bytes)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidArgumentError(f"{name} {value!r}: expected an int", **where)
        device_id, device_index = _resolve_device(device, where)
        if nccl_group is not None or nccl_by_caller:
            name = "nccl_group" if nccl_group is not None else "nccl_by_caller"
            if device_index is None:
                raise InvalidArgumentError(f"{name} applies to CUDA groups; a CPU group has no NCCL path", **where)
            if nccl_group is not None and nccl_by_caller:
                raise InvalidArgumentError("pass nccl_group or nccl_by_caller, not both", **where)
        if nccl_group is not None:
            _check_nccl_group(nccl_group, rank, world_size, where)
        if not timeout > 0:
            raise InvalidArgumentError(f"timeout {timeout!r}: expected a positive number of seconds", **where)
        if operation_timeout is not None and not 0 < operation_timeout < float("inf"):
            raise InvalidArgumentError(
                f"operation_timeout {operation_timeout!r}: expected a positive number of seconds", **where
            )
        try:
            group_wire = Wire.parse(wire)
        except (ValueError, AttributeError):
            raise InvalidArgumentError(f"wire {wire!r}: expected one of lossless, int8, fp8", **where) from None
        codes = []
        for dtype in dtypes:
            resolved = DTYPE_NAMES.get(dtype) if isinstance(dtype, str) else dtype
            if resolved not in DTYPE_CODES:
                raise InvalidArgumentError(f"dtype {dtype!r}: expected one of {list(DTYPE_NAMES)}", **where)
            codes.append(DTYPE_CODES[resolved])
        overrides = []
        for name, value in (thresholds or {}).items():
            try:
                overrides.append((name, parse_byte_size(str(value)) if value is not None else None))
            except ValueError as error:
                raise InvalidArgumentError(f"thresholds[{name!r}]: {error}", **where) from None
        if group_key is None:
            group_key = os.environ.get("NODECOMM_GROUP_KEY", "")
        if not isinstance(group_key, (str, bytes)):
            raise InvalidArgumentError(f"group_key: expected str or bytes, got {type(group_key).__name__}", **where)
        try:
            captured_abort = job_policy()
        except InvalidArgumentError as error:
            raise error.located(**where) from None
        spec = cls(
            group=group,
            rank=rank,
            world_size=world_size,
            device_id=device_id,
            device_index=device_index,
            capacity_bytes=capacity_bytes,
            dtypes=tuple(codes),
            overrides=tuple(overrides),
            wire=group_wire,
            nccl_fallback=nccl_group is not None or nccl_by_caller,
            nccl_by_caller=nccl_by_caller,
            table_switching=table_switching,
            group_key=group_key.encode() if isinstance(group_key, str) else group_key,
            timeout=timeout,
            operation_timeout=operation_timeout,
            captured_abort=captured_abort,
        )
        check_join(
            group, rank, world_size, spec.device_kind, capacity_bytes, spec.dtypes, group_wire.to_proto(),
            spec.nccl_fallback,
        )  # fmt: skip
        return spec

    def join_request(self, identity: bytes) -> pb.JoinRequest:
        return pb.JoinRequest(
            group=self.group,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device_id,
            geometry=pb.Geometry(capacity_bytes=self.capacity_bytes, dtypes=self.dtypes, wire=self.wire.to_proto()),
            pid=os.getpid(),
            join_timeout_seconds=self.timeout,
            nccl_fallback=self.nccl_fallback,
            overrides=[
                pb.Boundary(name=name, value_bytes=size) if size is not None else pb.Boundary(name=name)
                for name, size in self.overrides
            ],
            identity=identity,
            group_key=self.group_key,
        )


def _resolve_device(device: str | torch.device, where: dict) -> tuple[str, int | None]:
    """("cpu", None), or (the GPU's UUID, its CUDA index in this process): the daemon knows GPUs by
    UUID, since indices differ between processes and containers."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"device {device!r}: expected 'cpu', 'cuda' or 'cuda:N'", **where)
    if resolved.type == "cpu":
        return "cpu", None
    if not _native.WITH_CUDA:
        raise InvalidArgumentError(
            f"device {device!r}: this build of nodecomm has no CUDA transport (built without a CUDA toolkit)", **where
        )
    uuids = _native.cuda_device_uuids()
    index = resolved.index if resolved.index is not None else (torch.cuda.current_device() if uuids else 0)
    if not 0 <= index < len(uuids):
        raise InvalidArgumentError(
            f"device {device!r}: this process sees {len(uuids)} GPU(s); expected cuda:0..cuda:{len(uuids) - 1}"
            if uuids
            else f"device {device!r}: this process sees no GPU",
            **where,
        )
    return uuids[index], index


def _check_nccl_group(nccl_group: object, rank: int, world_size: int, where: dict) -> None:
    import torch.distributed as dist

    if not isinstance(nccl_group, dist.ProcessGroup):
        raise InvalidArgumentError(
            f"nccl_group: expected a torch.distributed.ProcessGroup, got {type(nccl_group).__name__}", **where
        )
    size, own_rank = dist.get_world_size(nccl_group), dist.get_rank(nccl_group)
    if (size, own_rank) != (world_size, rank):
        raise InvalidArgumentError(
            f"nccl_group has size {size} and this process as rank {own_rank}; expected size {world_size} and "
            f"rank {rank}, the same ranks as the group",
            **where,
        )
