"""Group memory: what the daemon allocates when a group forms, and frees when it is gone.

Every group gets one control segment: a page of host shared memory holding the abort word (and,
for CUDA groups, the kernels' error records), which ranks map and CUDA ranks also register with
their device. Each rank then gets one buffer, sized by the native transport from the agreed slot
capacity: a memfd segment for a CPU group, a CUDA VMM allocation on the rank's GPU for a CUDA
group. Both cross to the ranks as file descriptors. Everything is allocated before any rank is
answered; a failure half-way frees what was made, so all ranks get buffers or none do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from nodecomm import _native, host_memory
from nodecomm.errors import NodecommError, ResourceExhaustedError
from nodecomm.v1 import control_pb2 as pb

log = logging.getLogger("nodecomm.allocator")


ACCOUNTING_PAGE = 4096
# Descriptors kept for what must never fail for lack of one (the daemon's own sockets, a client's
# connection, the group releases that free the rest): this many, or a 64th of a lower limit.
DESCRIPTOR_RESERVE = 256


def raise_descriptor_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def check_descriptors(needed: int, what: str, **where) -> None:
    """ResourceExhaustedError unless `needed` more descriptors leave the reserve free."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    reserve = min(DESCRIPTOR_RESERVE, limit // 64)
    try:
        numbers = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError as error:  # EMFILE: not even one to look with
        raise ResourceExhaustedError(
            f"{what} failed: the daemon is out of descriptors ({error.strerror}); nothing was allocated", **where
        ) from None
    # The limit bounds descriptor numbers, not their count: the free ones are the numbers below it
    # that nothing holds (the listing's own is free again by now).
    free = limit - sum(1 for number in numbers if number < limit) + 1
    if needed > free - reserve:
        raise ResourceExhaustedError(
            f"{what} failed: it needs {needed} descriptors, and the daemon has {free} of its {limit} free (it "
            f"keeps {reserve} for its own work); nothing was allocated",
            **where,
        )


@dataclass
class DeviceMapping:
    """The daemon's own mapping of a CUDA allocation, kept until the group is released."""

    address: int
    size_bytes: int
    device: int  # the daemon's CUDA index of the GPU it is on


@dataclass
class GroupMemory:
    memory_kind: int  # pb.MemoryKind
    control_fd: int
    control_address: int
    buffer_fds: list[int]
    buffer_bytes: int
    device_mappings: list[DeviceMapping] = field(default_factory=list)
    # CUDA_IPC_LEGACY: (device, address, cudaIpcMemHandle bytes) per rank, no descriptors.
    legacy_buffers: list[tuple[int, int, bytes]] = field(default_factory=list)
    closed: bool = field(default=False)
    # Set where a stream of the daemon's may still wait on words in the buffers (the CUDA service
    # path's stream words): it unmaps them once that stream is idle, not at close.
    unmap_later: Callable[[int, int], None] | None = None
    # An adopted group's (service/groups/adoption.py): the ranks hold its buffers, this many, not the daemon.
    adopted_buffers: int = 0

    @property
    def buffer_count(self) -> int:
        return len(self.buffer_fds) or len(self.legacy_buffers) or self.adopted_buffers

    @property
    def ipc_handles(self) -> list[bytes]:
        """Each rank's buffer's cudaIpcMemHandle (legacy groups; empty otherwise)."""
        return [handle for _, _, handle in self.legacy_buffers]

    @property
    def control_bytes(self) -> int:
        return _native.CONTROL_BYTES

    @property
    def reserved_bytes(self) -> int:
        return self.control_bytes + self.buffer_bytes * self.buffer_count

    def descriptors(self) -> list[int]:
        """What a rank claims: the control segment, then every rank's buffer in rank order."""
        return [self.control_fd, *self.buffer_fds]

    @property
    def rank_buffers(self) -> list[tuple[int, int]]:
        """CUDA groups: (daemon CUDA index, the daemon's address) of every rank's buffer, in rank order."""
        if self.legacy_buffers:
            return [(device, address) for device, address, _ in self.legacy_buffers]
        return [(mapping.device, mapping.address) for mapping in self.device_mappings]

    def abort(self, reason: int, detail: int) -> None:
        """Put the abort on the control segment, which wakes every rank's abort watch (CUDA
        groups: native/cuda/abort_watch.h), so that the ranks' kernels stop at once."""
        if not self.closed:
            _native.abort_group(self.control_address, reason, detail)

    def abort_state(self) -> tuple[int, int]:
        """(reason, detail) on the control segment: a rank's kernel that gave up (a timeout, a
        mismatch) or its host (the daemon lost) may have set it; (0, 0) once closed."""
        return (0, 0) if self.closed else _native.abort_state(self.control_address)

    def captured_ranks(self, world_size: int) -> list[int]:
        """The ranks whose calls CUDA graphs hold (each rank counts its own on the control segment)."""
        if self.closed:
            return []
        return [rank for rank in range(world_size) if _native.captured_calls(self.control_address, rank)]

    def close(self) -> None:
        """Drop the daemon's references; ranks' mappings keep the memory until they unmap it."""
        if self.closed:
            return
        self.closed = True
        try:
            host_memory.unmap_segment(self.control_address, self.control_bytes)
            for mapping in self.device_mappings:
                if self.unmap_later is not None:
                    self.unmap_later(mapping.address, mapping.size_bytes)
                else:
                    _native.cuda_vmm_unmap(mapping.address, mapping.size_bytes)
            # Called once no rank is left (a legacy import does not keep the memory alive). On a
            # thread: cudaFree waits for the whole device, whose service streams may wait on ranks.
            if self.legacy_buffers:
                threading.Thread(
                    target=free_legacy_buffers, args=(self.legacy_buffers,), name="nodecomm-ipc-free", daemon=True
                ).start()
        finally:
            for fd in self.descriptors():
                os.close(fd)


def allocate_on_gpus(devices: list[int], nbytes: int, fds: list[int], mappings: list[DeviceMapping]) -> int:
    """One zeroed VMM allocation per entry of `devices`, all of one size (nbytes rounded up for the
    coarsest GPU), each appended to fds and mappings as it is made so that the caller's clean-up
    covers a failure half-way. Returns the size."""
    size = max(_native.cuda_vmm_rounded_size(device, nbytes) for device in devices)
    for device in devices:
        fd, address, made = _native.cuda_vmm_allocate(device, size)
        fds.append(fd)
        mappings.append(DeviceMapping(address, made, device))
        if made != size:
            raise ResourceExhaustedError(
                f"GPU {device} rounded a {size}-byte allocation to {made}; every rank's must have one size"
            )
    return size


def allocate_group(name: str, capacity_bytes: int, devices: list[int | None], cuda_memory: str = "vmm") -> GroupMemory:
    """Allocate a group whose rank r lives on `devices[r]`: None for a CPU rank (then all are
    None), else the daemon's CUDA index of the rank's GPU. cuda_memory: "vmm", "legacy", or
    "auto" (vmm, then legacy if that fails)."""
    if devices[0] is not None and cuda_memory != "vmm":
        if cuda_memory == "legacy":
            return _allocate_legacy_group(name, capacity_bytes, devices)
        try:
            return allocate_group(name, capacity_bytes, devices, "vmm")
        except ResourceExhaustedError as error:
            log.warning(
                "VMM buffers failed; trying cudaIpcMemHandle buffers", extra={"group": name, "error": str(error)}
            )
            return _allocate_legacy_group(name, capacity_bytes, devices)
    made_fds: list[int] = []
    mappings: list[DeviceMapping] = []
    try:
        control_fd = host_memory.create_segment(f"nodecomm:{name}:control", _native.CONTROL_BYTES)
        made_fds.append(control_fd)
        if devices[0] is None:
            kind, buffer_bytes = pb.HOST_MEMFD, _native.shm_buffer_bytes(capacity_bytes)
            for rank in range(len(devices)):
                made_fds.append(host_memory.create_segment(f"nodecomm:{name}:rank{rank}", buffer_bytes))
        else:
            kind = pb.CUDA_VMM_FD
            buffer_bytes = allocate_on_gpus(devices, _native.cuda_buffer_bytes(capacity_bytes), made_fds, mappings)
        control_address = host_memory.map_segment(control_fd, _native.CONTROL_BYTES)
    except (MemoryError, OSError, NodecommError) as error:
        for mapping in mappings:
            _native.cuda_vmm_unmap(mapping.address, mapping.size_bytes)
        for fd in made_fds:
            os.close(fd)
        where = "host" if devices[0] is None else f"GPUs {sorted(set(devices))}"
        raise ResourceExhaustedError(
            f"allocating {len(devices)} buffers for {capacity_bytes}-byte slots on {where} failed: {error}", group=name
        ) from None
    return GroupMemory(kind, control_fd, control_address, made_fds[1:], buffer_bytes, mappings)


def free_legacy_buffers(buffers: list[tuple[int, int, bytes]]) -> None:
    """cudaFree each (device, address, handle), going on past a failure (logged)."""
    for device, address, _ in buffers:
        try:
            _native.cuda_ipc_free(device, address)
        except NodecommError as error:
            log.error("freeing a cudaIpcMemHandle buffer failed", extra={"device": device, "error": str(error)})


def _allocate_legacy_group(name: str, capacity_bytes: int, devices: list[int]) -> GroupMemory:
    """A CUDA group whose buffers cross as cudaIpcMemHandle bytes (only the control page as a descriptor)."""
    buffer_bytes = _native.cuda_buffer_bytes(capacity_bytes)
    made: list[tuple[int, int, bytes]] = []
    control_fd = -1
    try:
        for device in devices:
            address, handle = _native.cuda_ipc_allocate(device, buffer_bytes)
            made.append((device, address, handle))
        control_fd = host_memory.create_segment(f"nodecomm:{name}:control", _native.CONTROL_BYTES)
        control_address = host_memory.map_segment(control_fd, _native.CONTROL_BYTES)
    except (MemoryError, OSError, NodecommError) as error:
        free_legacy_buffers(made)
        if control_fd >= 0:
            os.close(control_fd)
        raise ResourceExhaustedError(
            f"allocating {len(devices)} cudaIpcMemHandle buffers for {capacity_bytes}-byte slots on GPUs "
            f"{sorted(set(devices))} failed: {error}",
            group=name,
        ) from None
    return GroupMemory(pb.CUDA_IPC_LEGACY, control_fd, control_address, [], buffer_bytes, legacy_buffers=made)


@dataclass
class TopkSlabs:
    """A top-k exchange's memory: one slab per owner rank. Host memfds (nodecomm.topk_layout) for
    CPU groups; for CUDA groups, VMM allocations on each owner's GPU (native/cuda/topk.h), which
    the daemon keeps mapped until the group is released."""

    exchange_id: int
    fds: list[int]
    slab_bytes: int
    device_mappings: list[DeviceMapping] = field(default_factory=list)
    closed: bool = field(default=False)

    @property
    def reserved_bytes(self) -> int:
        return accounted_bytes(self.slab_bytes) * len(self.fds)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                for mapping in self.device_mappings:
                    _native.cuda_vmm_unmap(mapping.address, mapping.size_bytes)
            finally:
                for fd in self.fds:
                    os.close(fd)


def allocate_cuda_topk_slabs(name: str, exchange_id: int, devices: list[int], slab_bytes: int) -> TopkSlabs:
    """One zeroed slab per owner on its GPU (devices[owner], the daemon's CUDA index), all of one size."""
    fds: list[int] = []
    mappings: list[DeviceMapping] = []
    try:
        size = allocate_on_gpus(devices, slab_bytes, fds, mappings)
    except (MemoryError, OSError, NodecommError) as error:
        TopkSlabs(exchange_id, fds, 0, mappings).close()
        raise ResourceExhaustedError(
            f"allocating {len(devices)} top-k slabs of {slab_bytes} bytes on GPUs {sorted(set(devices))} failed: {error}",
            group=name,
        ) from None
    return TopkSlabs(exchange_id, fds, size, mappings)


def allocate_topk_slabs(name: str, exchange_id: int, world_size: int, slab_bytes: int) -> TopkSlabs:
    made: list[int] = []
    try:
        for owner in range(world_size):
            made.append(host_memory.create_segment(f"nodecomm:{name}:topk{exchange_id}:owner{owner}", slab_bytes))
    except (MemoryError, OSError) as error:
        for fd in made:
            os.close(fd)
        raise ResourceExhaustedError(
            f"allocating {world_size} top-k slabs of {slab_bytes} bytes failed: {error}", group=name
        ) from None
    return TopkSlabs(exchange_id, made, slab_bytes)


@dataclass
class RankAllocation:
    """Memory one rank asked for, for the service path: a sealed memfd (CPU groups) or a VMM
    allocation on the rank's GPU (CUDA groups) that the rank maps and the daemon keeps mapped, so
    that collectives submitted on it run without copies. Unmapped once the rank has freed it (or
    the group is released) and no queued collective names it any more."""

    allocation_id: int
    rank: int
    fd: int
    address: int
    size_bytes: int
    placement: tuple[str, str] = ("host", "host")  # the metrics' (kind, device)
    # Device memory: how to unmap it once the GPU is done with it (the group's executor sets it).
    unmap_device: Callable[[RankAllocation], None] | None = None
    users: int = 0  # queued or running collectives that name it
    freed: bool = False
    closed: bool = False

    def release(self) -> None:
        """One user is done with it; the last one unmaps a freed allocation."""
        self.users -= 1
        if self.freed and self.users == 0:
            self.close()

    def free(self) -> None:
        self.freed = True
        if self.users == 0:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.unmap_device is not None:
                self.unmap_device(self)
                return
            host_memory.unmap_segment(self.address, self.size_bytes)
            os.close(self.fd)


def allocate_rank_device_memory(
    name: str, rank: int, allocation_id: int, size_bytes: int, device: int, uuid: str, executing_device: int
) -> RankAllocation:
    """A VMM allocation on the rank's GPU (`device`, the daemon's CUDA index), which the group's
    executing GPU may also read and write (peer access) where that is another one."""
    fds: list[int] = []
    mappings: list[DeviceMapping] = []
    try:
        size = allocate_on_gpus([device], size_bytes, fds, mappings)
        if executing_device != device:
            _native.cuda_vmm_grant(executing_device, mappings[0].address, size)
    except (MemoryError, OSError, NodecommError) as error:
        for mapping in mappings:
            _native.cuda_vmm_unmap(mapping.address, mapping.size_bytes)
        for fd in fds:
            os.close(fd)
        raise ResourceExhaustedError(
            f"allocating {size_bytes} bytes on GPU {uuid} for rank {rank} failed: {error}", group=name
        ) from None
    return RankAllocation(allocation_id, rank, fds[0], mappings[0].address, size, placement=("cuda", uuid))


def accounted_bytes(size_bytes: int) -> int:
    """What a piece of memory counts against max_reserved_bytes: at least a page, in whole pages,
    since each costs a descriptor and a mapping however few bytes it holds."""
    return -(-max(size_bytes, 1) // ACCOUNTING_PAGE) * ACCOUNTING_PAGE


def allocate_rank_memory(name: str, rank: int, allocation_id: int, size_bytes: int) -> RankAllocation:
    try:
        fd = host_memory.create_segment(f"nodecomm:{name}:rank{rank}:alloc{allocation_id}", size_bytes)
    except (MemoryError, OSError) as error:
        raise ResourceExhaustedError(
            f"allocating {size_bytes} bytes of host memory failed: {error}", group=name
        ) from None
    try:
        address = host_memory.map_segment(fd, size_bytes)
    except OSError as error:
        os.close(fd)
        raise ResourceExhaustedError(f"mapping {size_bytes} bytes of host memory failed: {error}", group=name) from None
    return RankAllocation(allocation_id, rank, fd, address, size_bytes)


def max_blocks_for(devices: list[int]) -> int:
    """The grid cap of a CUDA group whose rank r runs on daemon GPU index devices[r]: every rank's
    grid must be resident at once, so ranks sharing a GPU split what it holds."""
    ranks_on = Counter(devices)
    fits = [_native.cuda_resident_blocks(device) // ranks for device, ranks in ranks_on.items()]
    return max(1, min([_native.CUDA_MAX_BLOCKS, *fits]))
