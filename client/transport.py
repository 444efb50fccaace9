"""Transport: what a Communicator asks of its group's transport, the CPU one (host_transport.py)
or the CUDA one (cuda_transport.py). Each runs its kind's paths through a native lane and the
other collectives through its native group; what only one kind has (NCCL through the engine's
group and top-k stages on CUDA; the top-k barrier on the CPU) is called only where that kind's dispatch or
exchange leads."""

from __future__ import annotations

from typing import Protocol

import torch

from nodecomm import _native
from nodecomm.capabilities import DeviceKind
from nodecomm.thresholds import Path, Wire

from .dtypes import DTYPE_CODES


class Transport(Protocol):
    kind: DeviceKind
    device: torch.device
    paths: frozenset[Path]  # what the dispatch may pick: the kind's (nodecomm.capabilities), NCCL where given
    wire_paths: frozenset[Path]  # those of them that carry compressed wires
    memory_outlives_daemon: bool  # the group's buffers live while this rank maps them, daemon or not

    def lane(self, dispatch: _native.Dispatch, control: int, timeout: float, lock: _native.CallLock) -> object:
        """The native all-reduce call on this group (native/lane_api.h)."""
        ...

    def stream(self) -> int:
        """The stream a call is enqueued on (0: none, the call runs on the calling thread)."""
        ...

    def on_device(self, tensor: torch.Tensor) -> bool: ...

    def variant(self, path: Path, nbytes: int, wire: Wire = Wire.LOSSLESS) -> str:
        """How `path` moves `nbytes`: its variant ("push", "pull"), or "" where a path has one."""
        ...

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor, timeout: float) -> None: ...

    def add_rms_norm(
        self, summed: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
        out: torch.Tensor, residual_out: torch.Tensor,
    ) -> None:  # fmt: skip
        """residual_out = summed + residual, out = rms_norm(residual_out) * weight in the order of
        nodecomm.rms_norm, on this rank alone (after an all-reduce that ran apart)."""
        ...

    def barrier(self, timeout: float) -> bool:
        """Whether every rank entered the barrier. False where this rank's wait gave up (a CUDA
        kernel cannot raise): that aborted the group, and the abort says why."""
        ...

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph."""
        ...

    def synchronize(self) -> None:
        """Block until this rank's collectives have finished on the device."""
        ...

    def close(self) -> None: ...


def rms_norm_arguments(
    summed: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    out: torch.Tensor, residual_out: torch.Tensor,
) -> tuple:  # fmt: skip
    """add_rms_norm's arguments as the native functions take them: the five addresses, rows,
    hidden, eps and the dtype's code."""
    hidden = weight.numel()
    addresses = (summed.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), residual_out.data_ptr())
    return (*addresses, summed.numel() // hidden, hidden, eps, DTYPE_CODES[summed.dtype])
