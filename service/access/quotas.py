"""What the daemon may still hand out, checked before anything is allocated: descriptors, the bytes
counted against max_reserved_bytes and the caller's share of them, each GPU's bytes, and the open
allocations per rank and per caller. Every refusal is a ResourceExhaustedError that says which
bound and what is held."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

from nodecomm import _native
from nodecomm.capabilities import DeviceKind
from nodecomm.errors import ResourceExhaustedError
from nodecomm.service.access.callers import Caller
from nodecomm.service.config import DaemonConfig
from nodecomm.service.memory.allocator import accounted_bytes, check_descriptors

if TYPE_CHECKING:
    from nodecomm.service.groups.group import Group
    from nodecomm.service.groups.join_args import JoinArgs


class Quotas:
    """The daemon's bounds over `groups`, the registry's formed groups by id (read, never changed)."""

    def __init__(self, config: DaemonConfig, groups: Mapping[int, Group]):
        self.config = config
        self._groups = groups

    def reserved_bytes(self) -> int:
        """Bytes every group not yet released holds, counted against max_reserved_bytes."""
        return sum(group.reserved_bytes for group in self._groups.values())

    def reserved_by(self, caller: Caller) -> int:
        """Bytes the groups `caller` formed hold, counted against max_reserved_bytes_per_caller."""
        return sum(group.reserved_bytes for group in self._groups.values() if group.creator == caller)

    def check_group(self, args: JoinArgs, devices: list[str], creator: Caller) -> None:
        """A group `creator` is about to form on `devices` (each rank's): its descriptors, every
        GPU's bytes, the daemon's and the creator's share."""
        where = dict(group=args.group)
        # The segments, each rank's claim of all of them, and one claiming connection.
        segments = args.world_size + 1
        check_descriptors(segments * (args.world_size + 1) + 1, "the group", **where)
        if args.device_kind == DeviceKind.CPU:
            buffer_bytes = _native.shm_buffer_bytes(args.capacity_bytes)
        else:
            buffer_bytes = _native.cuda_buffer_bytes(args.capacity_bytes)
            on_gpu = Counter()
            for group in self._groups.values():
                for kind, device, _, nbytes in group.placement():
                    if kind == DeviceKind.CUDA:
                        on_gpu[device] += nbytes
            for device, ranks in Counter(devices).items():
                if on_gpu[device] + ranks * buffer_bytes > self.config.max_bytes_per_gpu:
                    raise ResourceExhaustedError(
                        f"GPU {device} would hold {on_gpu[device] + ranks * buffer_bytes} bytes of buffers, past "
                        f"this daemon's max_bytes_per_gpu {self.config.max_bytes_per_gpu}; nothing was allocated",
                        **where,
                    )
        self._check_bytes(_native.CONTROL_BYTES + args.world_size * buffer_bytes, "the group", creator, where)

    def check_allocation(self, group: Group, held_by_rank: int, size_bytes: int, where: dict) -> None:
        """One more service-path allocation of `size_bytes` for a rank that holds `held_by_rank`."""
        check_descriptors(3, "the allocation", **where)  # the memory, the claim's copy, the claim's connection
        if held_by_rank >= self.config.max_allocations_per_rank:
            raise ResourceExhaustedError(
                f"rank {where.get('rank')} holds {held_by_rank} allocations, this daemon's max_allocations_per_rank; "
                "free one first",
                **where,
            )
        self.check_caller(group, where)
        self._check_bytes(
            accounted_bytes(size_bytes), f"allocating {size_bytes} bytes (whole pages)", group.creator, where
        )

    def check_exchange(self, group: Group, needed_bytes: int) -> None:
        """The slabs of a top-k exchange that every rank agreed on: `needed_bytes` in all."""
        where = dict(group=group.name)
        check_descriptors(3 * group.args.world_size, "the exchange", **where)
        self._check_bytes(needed_bytes, "the exchange", group.creator, where)

    def check_caller(self, group: Group, where: dict) -> None:
        """One more allocation or exchange where the groups of `group`'s creator hold
        max_allocations_per_caller of them: per-rank and per-group counts bound one group, this
        bounds many small ones."""
        held = 0
        for other in self._groups.values():
            if other.creator != group.creator:
                continue
            held += len(other.topk_slabs)
            if other.service is not None:
                held += sum(1 for allocation in other.service.allocations.values() if not allocation.freed)
        if held >= self.config.max_allocations_per_caller:
            raise ResourceExhaustedError(
                f"the groups of {group.creator} hold {held} allocations and top-k exchanges, this daemon's "
                "max_allocations_per_caller; free one or close a group first",
                **where,
            )

    def _check_bytes(self, needed: int, what: str, caller: Caller, where: dict) -> None:
        reserved = self.reserved_bytes()
        if reserved + needed > self.config.max_reserved_bytes:
            raise ResourceExhaustedError(
                f"{what} needs {needed} bytes but the daemon already reserves {reserved} of its "
                f"max_reserved_bytes {self.config.max_reserved_bytes}; nothing was allocated",
                **where,
            )
        mine = self.reserved_by(caller)
        if mine + needed > self.config.max_reserved_bytes_per_caller:
            raise ResourceExhaustedError(
                f"{what} needs {needed} bytes but the groups of {caller} already reserve {mine} of this daemon's "
                f"max_reserved_bytes_per_caller {self.config.max_reserved_bytes_per_caller}; nothing was allocated",
                **where,
            )
