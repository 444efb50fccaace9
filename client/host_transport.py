"""HostTransport: a CPU group's collectives, run by the C++ `shm` transport on host shared memory."""

from __future__ import annotations

import time

import torch

from nodecomm import _native
from nodecomm.thresholds import Path, Wire

from .dtypes import DTYPE_CODES
from .mapping import SegmentMapping


class HostTransport:
    kind = "cpu"
    paths = frozenset({Path.ONESHOT, Path.TWOSHOT})
    wire_paths = paths  # both carry compressed wires (native/shm.h)

    def __init__(
        self, rank: int, world_size: int, buffers: list[SegmentMapping], control: SegmentMapping, slot_bytes: int
    ):
        self.device = torch.device("cpu")
        self._buffers = buffers
        # The native group chunks payloads past one slot itself.
        self._group = _native.ShmGroup(rank, world_size, [b.address for b in buffers], control.address, slot_bytes)

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cpu

    def form(self, path: Path, nbytes: int, wire: Wire = Wire.LOSSLESS) -> str:
        """Host paths have one form each."""
        return ""

    def all_reduce_dispatched(
        self,
        dispatch: _native.Dispatch,
        tensor: torch.Tensor,
        out: torch.Tensor,
        timeout: float,
        forced: int = 0,
        wire: int = -1,
    ) -> tuple[int, int, float]:
        """An all-reduce on the path and wire `dispatch` decides (forced: a path code, 0: the
        table's; wire: a wire code, -1: the table's), run, timed and counted in one native call:
        (path, wire, seconds; -1 unless sampled). Not run when decided for the service path, which
        the caller submits."""
        return self._group.all_reduce_dispatched(
            dispatch,
            tensor.data_ptr(),
            out.data_ptr(),
            tensor.numel(),
            DTYPE_CODES[tensor.dtype],
            timeout,
            forced,
            wire,
        )

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor, timeout: float) -> None:
        self._group.all_gather(tensor.data_ptr(), out.data_ptr(), tensor.numel() * tensor.element_size(), timeout)

    def barrier(self, timeout: float) -> None:
        self._group.barrier(timeout)

    def topk_barrier(self, rows: int, timeout: float) -> None:
        """A top-k stage's barrier: the ranks must stage the same number of rows."""
        self._group.barrier(timeout, _native.Collective.TOPK_STAGE, rows)

    # Timing samples: collectives here block, so a sample is complete when the call returns.
    def capturing(self) -> bool:
        return False

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed(self, start: float, end: float) -> float | None:
        return end - start

    def synchronize(self) -> None:
        """Nothing to wait for: collectives here have finished when they return."""

    def close(self) -> None:
        self._group = None
        for mapping in self._buffers:
            mapping.unmap()
