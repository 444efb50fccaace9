"""Group memory: what the daemon allocates when a group forms, and frees when it is gone.

A CPU group gets one control segment (the abort word) and one buffer segment per rank, sized by the
native transport from the agreed slot capacity. Everything is allocated before any rank is
answered; a failure half-way frees what was made, so all ranks get buffers or none do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from nodecomm import _native, host_memory
from nodecomm.errors import ResourceExhaustedError


@dataclass
class HostGroupMemory:
    control_fd: int
    control_address: int
    buffer_fds: list[int]
    buffer_bytes: int
    closed: bool = field(default=False)

    @property
    def control_bytes(self) -> int:
        return _native.SHM_CONTROL_BYTES

    @property
    def reserved_bytes(self) -> int:
        return self.control_bytes + self.buffer_bytes * len(self.buffer_fds)

    def descriptors(self) -> list[int]:
        """What a rank claims: the control segment, then every rank's buffer in rank order."""
        return [self.control_fd, *self.buffer_fds]

    def abort(self, reason: int, detail: int) -> None:
        if not self.closed:
            _native.abort_group(self.control_address, reason, detail)

    def close(self) -> None:
        """Drop the daemon's references; ranks' mappings keep the pages until they unmap."""
        if self.closed:
            return
        self.closed = True
        try:
            host_memory.unmap_segment(self.control_address, self.control_bytes)
        finally:
            for fd in self.descriptors():
                os.close(fd)


def allocate_host_group(name: str, world_size: int, slot_bytes: int) -> HostGroupMemory:
    made: list[int] = []
    try:
        control_fd = host_memory.create_segment(f"nodecomm:{name}:control", _native.SHM_CONTROL_BYTES)
        made.append(control_fd)
        buffer_bytes = _native.shm_buffer_bytes(slot_bytes)
        for rank in range(world_size):
            made.append(host_memory.create_segment(f"nodecomm:{name}:rank{rank}", buffer_bytes))
        control_address = host_memory.map_segment(control_fd, _native.SHM_CONTROL_BYTES)
    except (MemoryError, OSError) as error:
        for fd in made:
            os.close(fd)
        raise ResourceExhaustedError(
            f"allocating {world_size} x {slot_bytes}-byte slot buffers failed: {error}", group=name
        ) from None
    return HostGroupMemory(control_fd, control_address, made[1:], buffer_bytes)
