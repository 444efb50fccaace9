"""HostTransport: a CPU group's collectives, run by the C++ `shm` transport on host shared memory."""

from __future__ import annotations

import torch

from nodecomm import _native
from nodecomm.capabilities import CAPABILITIES, DeviceKind
from nodecomm.thresholds import Path, Wire

from .mapping import SegmentMapping
from .transport import rms_norm_arguments


class HostTransport:
    kind = DeviceKind.CPU
    paths = CAPABILITIES[DeviceKind.CPU].paths
    wire_paths = CAPABILITIES[DeviceKind.CPU].wire_paths
    memory_outlives_daemon = True  # memfds: mapped, they live on

    def __init__(
        self, rank: int, world_size: int, buffers: list[SegmentMapping], control: SegmentMapping, capacity_bytes: int
    ):
        self.device = torch.device("cpu")
        self._buffers = buffers
        # The native group chunks payloads past one slot itself; all-reduces run through a
        # HostLane made on it (the Communicator's).
        self.group = _native.ShmGroup(rank, world_size, [b.address for b in buffers], control.address, capacity_bytes)

    def lane(
        self, dispatch: _native.Dispatch, control: int, timeout: float, lock: _native.CallLock
    ) -> _native.HostLane:
        """The native all-reduce call on this group (native/host_lane.h)."""
        return _native.HostLane(self.group, dispatch, control, timeout, lock)

    def stream(self) -> int:
        """No stream: a CPU collective runs on the calling thread."""
        return 0

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cpu

    def variant(self, path: Path, nbytes: int, wire: Wire = Wire.LOSSLESS) -> str:
        """Host paths have one variant each."""
        return ""

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor, timeout: float) -> None:
        self.group.all_gather(tensor.data_ptr(), out.data_ptr(), tensor.numel() * tensor.element_size(), timeout)

    def add_rms_norm(
        self, summed: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
        out: torch.Tensor, residual_out: torch.Tensor,
    ) -> None:  # fmt: skip
        _native.add_rms_norm(*rms_norm_arguments(summed, residual, weight, eps, out, residual_out))

    def barrier(self, timeout: float) -> bool:
        self.group.barrier(timeout)  # raises what stopped it (native/shm.h)
        return True

    def topk_barrier(self, rows: int, timeout: float) -> None:
        """A top-k stage's barrier: the ranks must stage the same number of rows."""
        self.group.barrier(timeout, _native.Collective.TOPK_STAGE, rows)

    def capturing(self) -> bool:
        """Never: no CUDA graph captures a CPU collective (its samples are timed natively)."""
        return False

    def synchronize(self) -> None:
        """Nothing to wait for: collectives here have finished when they return."""

    def close(self) -> None:
        self.group = None
        for mapping in self._buffers:
            mapping.unmap()
