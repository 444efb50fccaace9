"""SegmentMapping: one segment of a group's memory (the control page, a rank's buffer, a top-k
slab, a service allocation's view) as mapped in this process: host memory from a memfd, device
memory from a VMM descriptor, or a legacy cudaIpcMemHandle import. Each mapping knows how it was
made and so how to let go of it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from nodecomm import _native, host_memory
from nodecomm.errors import DaemonUnavailableError


class MappedFrom(enum.Enum):
    MEMFD = "memfd"  # host memory
    VMM = "vmm"  # device memory, from an exported allocation's descriptor
    IPC_HANDLE = "ipc_handle"  # device memory, a legacy cudaIpcMemHandle import


@dataclass
class SegmentMapping:
    address: int
    size_bytes: int
    source: MappedFrom = MappedFrom.MEMFD
    device: int | None = None  # the GPU a device mapping was made on

    @classmethod
    def from_descriptor(cls, fd: int, size: int, device: int | None, where: dict) -> SegmentMapping:
        """Map what a descriptor the daemon sent holds: a memfd (device None), checked to be as
        large as announced, or a VMM allocation, on `device`. The descriptor stays the caller's."""
        if device is not None:
            return cls(_native.cuda_vmm_import(device, fd, size), size, MappedFrom.VMM, device)
        actual = host_memory.segment_size(fd)
        if actual < size:
            raise DaemonUnavailableError(f"segment of {actual} bytes is smaller than announced {size}", **where)
        return cls(host_memory.map_segment(fd, size), size)

    @classmethod
    def from_ipc_handle(cls, handle: bytes, size: int, device: int) -> SegmentMapping:
        return cls(_native.cuda_ipc_open(device, handle), size, MappedFrom.IPC_HANDLE, device)

    def unmap(self) -> None:
        """Let go of the memory here (device memory only once nothing runs on it)."""
        if self.source is MappedFrom.MEMFD:
            host_memory.unmap_segment(self.address, self.size_bytes)
        elif self.source is MappedFrom.VMM:
            _native.cuda_vmm_unmap(self.address, self.size_bytes)
        else:
            _native.cuda_ipc_close(self.device, self.address)


def map_descriptors(fds: list[int], sizes: list[int], device: int | None, where: dict) -> list[SegmentMapping]:
    """Map every descriptor (SegmentMapping.from_descriptor), all or none: past a failure the
    ones mapped are unmapped before it propagates."""
    mappings: list[SegmentMapping] = []
    try:
        for fd, size in zip(fds, sizes, strict=True):
            mappings.append(SegmentMapping.from_descriptor(fd, size, device, where))
    except BaseException:
        for mapping in mappings:
            mapping.unmap()
        raise
    return mappings
