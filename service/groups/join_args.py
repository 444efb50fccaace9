"""What a Join asks for: its arguments as the daemon compares them between ranks (JoinArgs), and
the checks every Join passes before it reaches a forming group (validate_join)."""

from __future__ import annotations

from dataclasses import dataclass

from nodecomm.byte_size import format_byte_size
from nodecomm.capabilities import DeviceKind
from nodecomm.errors import InvalidArgumentError, ResourceExhaustedError, shown
from nodecomm.join_rules import DTYPE_NAMES, check_join
from nodecomm.service.config import DEFAULT_BOUNDARIES, DaemonConfig
from nodecomm.v1 import control_pb2 as pb


@dataclass(frozen=True)
class JoinArgs:
    group: str
    rank: int
    world_size: int
    device: str
    capacity_bytes: int
    dtypes: tuple[int, ...]
    pid: int  # the process the Join declares
    uid: int  # who joined (callers.py): its claims are bound to it
    nccl_fallback: bool
    overrides: tuple[tuple[str, int | None], ...] = ()  # this group's own, sorted by name
    wire: int = pb.LOSSLESS  # the compressed wire the group lets its table use

    @classmethod
    def from_request(cls, request: pb.JoinRequest, uid: int) -> JoinArgs:
        return cls(
            group=request.group,
            rank=request.rank,
            world_size=request.world_size,
            device=request.device,
            capacity_bytes=request.geometry.capacity_bytes,
            dtypes=tuple(sorted(set(request.geometry.dtypes))),
            pid=request.pid,
            uid=uid,
            nccl_fallback=request.nccl_fallback,
            wire=request.geometry.wire,
            # By name, then off (None) before values: a name given twice, once without a value,
            # must reach validate_join (which refuses it) instead of comparing None with an int.
            overrides=tuple(
                sorted(
                    ((b.name, b.value_bytes if b.HasField("value_bytes") else None) for b in request.overrides),
                    key=lambda item: (item[0], item[1] is not None, item[1] or 0),
                )
            ),
        )

    def to_request(self) -> pb.JoinRequest:
        """The Join these arguments came from (what a group's record keeps: service/groups/adoption.py)."""
        return pb.JoinRequest(
            group=self.group,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            geometry=pb.Geometry(capacity_bytes=self.capacity_bytes, dtypes=self.dtypes, wire=self.wire),
            pid=self.pid,
            nccl_fallback=self.nccl_fallback,
            overrides=[pb.Boundary(name=n, value_bytes=v) for n, v in self.overrides],
        )

    # The fields every rank must agree on, with how to show a value in an error.
    AGREED = ("world_size", "device_kind", "capacity_bytes", "dtypes", "nccl_fallback", "overrides", "wire")

    @property
    def device_kind(self) -> DeviceKind:
        return DeviceKind.CPU if self.device == DeviceKind.CPU else DeviceKind.CUDA

    def shown(self, name: str) -> str:
        value = getattr(self, name)
        if name == "dtypes":
            return "[" + ", ".join(DTYPE_NAMES[d] for d in value) + "]"
        if name == "overrides":
            return "{" + ", ".join(f"{n}={format_byte_size(v)}" for n, v in value) + "}"
        if name == "wire":
            return pb.Wire.Name(value).lower() if value in pb.Wire.values() else str(value)
        return str(value)


def validate_join(args: JoinArgs, config: DaemonConfig, gpus: list[str]) -> None:
    """nodecomm.join_rules' checks (the client ran them too), then what only this daemon knows."""
    check_join(
        args.group, args.rank, args.world_size, args.device_kind, args.capacity_bytes, args.dtypes, args.wire,
        args.nccl_fallback,
    )  # fmt: skip
    where = dict(group=args.group or None, rank=args.rank)
    if args.world_size > config.max_ranks_per_group:
        raise ResourceExhaustedError(
            f"world_size {args.world_size} exceeds this daemon's max_ranks_per_group {config.max_ranks_per_group}",
            **where,
        )
    if args.device != DeviceKind.CPU and args.device not in gpus:
        seen = f"the GPUs it sees are {gpus}" if gpus else "it sees no GPUs (no CUDA build, driver or device)"
        raise InvalidArgumentError(
            f"device {args.device[:80]!r}: expected 'cpu' or the UUID of a GPU this daemon sees; {seen}", **where
        )
    if args.capacity_bytes > config.max_capacity_bytes:
        raise ResourceExhaustedError(
            f"geometry.capacity_bytes {args.capacity_bytes} exceeds this daemon's max_capacity_bytes "
            f"{config.max_capacity_bytes}",
            **where,
        )
    names = [name for name, _ in args.overrides]
    unknown = sorted(set(names) - set(DEFAULT_BOUNDARIES[args.device_kind]))
    if unknown or len(set(names)) != len(names):
        raise InvalidArgumentError(
            f"overrides {shown(names, 200)}: expected each of {sorted(DEFAULT_BOUNDARIES[args.device_kind])} "
            f"at most once for a {args.device_kind.upper()} group",
            **where,
        )
    if args.pid <= 0:
        raise InvalidArgumentError(f"pid {args.pid}: expected the joining process's pid", **where)
