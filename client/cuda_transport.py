"""CudaTransport: a CUDA group's collectives, enqueued on the caller's current stream.

The kernels and copies live in nodecomm._native (CudaGroup, which also cuts payloads larger than
one slot into slot-sized pieces); the lane runs the NCCL path through the engine's own process
group (nodecomm._c10d.NcclRunner). Nothing here synchronises the host except barrier(), so every
collective can be captured in a CUDA graph; a captured graph keeps the path it was captured with.
"""

from __future__ import annotations

import contextlib
import time

import torch

from nodecomm import _native
from nodecomm.capabilities import CAPABILITIES, DeviceKind
from nodecomm.errors import GroupMismatchError
from nodecomm.thresholds import PEER_PATHS, Path, Wire

from . import c10d_module
from .dtypes import DTYPE_CODES
from .mapping import MappedFrom, SegmentMapping
from .transport import rms_norm_arguments

_RECORDS_WAIT_SECONDS = 0.5


def mismatch_error(control_address: int, world_size: int, **where) -> GroupMismatchError:
    """What a group aborted on a mismatch raises: the ranks' records name the field and values.
    Ranks record their calls as their kernels notice the abort (within an abort poll, 0.1 ms, of
    running), so a record still missing is waited for, briefly."""
    deadline = time.monotonic() + _RECORDS_WAIT_SECONDS
    while True:
        disagreement, complete = _native.recorded_disagreement(control_address, world_size)
        if complete or time.monotonic() > deadline:
            break
        time.sleep(0.002)
    # The kernels' counters and pushed lines are out of step between the ranks by then, and only
    # ranks whose streams are all idle could set them back together: a new group is that.
    return GroupMismatchError(
        f"{disagreement}; nothing was written to the output; a CUDA group stops at a mismatch: close this "
        "communicator and connect again",
        **where,
    )


class CudaTransport:
    kind = DeviceKind.CUDA

    def __init__(
        self,
        rank: int,
        world_size: int,
        device_index: int,
        buffers: list[SegmentMapping],
        control: SegmentMapping,
        capacity_bytes: int,
        max_blocks: int,
        nccl_group: object | None,
    ):
        self.device = torch.device("cuda", device_index)
        self._index = device_index
        self.rank, self.world_size = rank, world_size
        capabilities = CAPABILITIES[DeviceKind.CUDA]
        self.wire_paths = capabilities.wire_paths
        self.paths = capabilities.paths | ({Path.NCCL} if nccl_group else set())
        self._buffers = buffers
        # VMM allocations live while any process holds a handle; legacy IPC memory is the daemon's
        # cudaMalloc, freed when it exits.
        self.memory_outlives_daemon = all(b.source is not MappedFrom.IPC_HANDLE for b in buffers)
        self._control = control
        self._nccl_group = nccl_group
        self.group = _native.CudaGroup(
            rank, world_size, [b.address for b in buffers], control.address, capacity_bytes, device_index, max_blocks
        )

    # -- the checks connect() runs before the group is used ----------------------------------

    def probe_peers(self, nonce: int, timeout: float) -> str:
        """Write a tag into every peer's buffer and wait for every peer's: "" or what failed."""
        return self.group.check_peers(nonce, timeout)

    def self_test(self, timeout: float) -> str:
        """One small all-reduce through every peer path, checked exactly: "" or what was wrong."""
        pattern = torch.arange(1000, device=self.device, dtype=torch.float32) % 7
        expected = pattern * self.world_size + self.world_size * (self.world_size - 1) // 2
        for path in PEER_PATHS:
            mine, out = pattern + self.rank, torch.empty_like(pattern)
            with self._enqueueing():
                self.group.all_reduce(
                    mine.data_ptr(), out.data_ptr(), mine.numel(), DTYPE_CODES[mine.dtype], path.to_proto(), timeout,
                    self.stream(), 0,
                )  # fmt: skip
            # This stream only: a device-wide wait would also wait for other groups' kernels (two
            # pair groups join at once on one rank), which wait for their own peers, while this
            # group's peer waits for this rank's next self-test kernel, with the self-test's timeout.
            torch.cuda.current_stream(self.device).synchronize()
            wrong = int((out != expected).sum())
            if wrong:
                return f"a {path.value} all-reduce of 1000 float32 gave {wrong} wrong elements"
        return ""

    def drop_peer_paths(self) -> None:
        """After a failed check: only the engine's NCCL group carries collectives (none at all
        when the caller runs NCCL itself)."""
        self.paths = frozenset({Path.NCCL}) if self._nccl_group is not None else frozenset()

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.get_device() == self._index  # an int, not a torch.device made per call

    def variant(self, path: Path, nbytes: int, wire: Wire = Wire.LOSSLESS) -> str:
        """How `path` moves an all-reduce of `nbytes`: oneshot "push" (into peers' push slots) or
        "pull" (from their staging slots; always over a compressed wire), as the native group
        decides; "" for the other paths."""
        if path is not Path.ONESHOT:
            return ""
        return "push" if wire is Wire.LOSSLESS and self.group.oneshot_pushes(nbytes) else "pull"

    @contextlib.contextmanager
    def _enqueueing(self):
        """The native group raises a bare GroupMismatchError on a group that a mismatch stopped,
        once this rank's call is on record: the message comes from every rank's record."""
        try:
            yield
        except GroupMismatchError:
            raise mismatch_error(self._control.address, self.world_size) from None

    def lane(
        self, dispatch: _native.Dispatch, control: int, timeout: float, lock: _native.CallLock
    ) -> _native.CudaLane:
        """The native all-reduce call on this group (native/cuda/lane.h), which runs the calls it
        decides for NCCL through the engine's group where one was given."""
        lane = _native.CudaLane(self.group, dispatch, control, timeout, lock)
        if self._nccl_group is not None:
            runner = c10d_module().NcclRunner(self._nccl_group, self._index)
            lane.set_nccl(runner.api(), runner)
        return lane

    def stream(self) -> int:
        """The caller's current stream on this group's device, as torch's launches would use it
        (the raw handle: torch.cuda.current_stream() builds a Stream object per call)."""
        return torch._C._cuda_getCurrentRawStream(self._index)

    def add_rms_norm(
        self, summed: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
        out: torch.Tensor, residual_out: torch.Tensor,
    ) -> None:  # fmt: skip
        arguments = rms_norm_arguments(summed, residual, weight, eps, out, residual_out)
        _native.cuda_add_rms_norm(*arguments, self._index, self.stream())

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor, timeout: float) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        with self._enqueueing():
            self.group.all_gather(tensor.data_ptr(), out.data_ptr(), nbytes, timeout, self.stream())

    def barrier(self, timeout: float) -> bool:
        stream = torch.cuda.current_stream(self.device)
        with self._enqueueing():
            self.group.barrier(timeout, stream.cuda_stream)
        stream.synchronize()  # bounded: the barrier kernel gives up after `timeout` or an abort
        # A kernel that gave up recorded why and aborted the group; the abort is the error.
        code, _, _ = _native.error_record(self._control.address, self.rank)
        return code == _native.KernelError.NONE

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def topk_stage(
        self,
        slabs: list[int],
        rows_per_owner: int,
        topk: int,
        blocks: int,
        idx: torch.Tensor,
        scores: torch.Tensor,
        out_idx: torch.Tensor,
        out_scores: torch.Tensor,
        timeout: float,
    ) -> None:
        with self._enqueueing():
            self.group.topk_stage(
                slabs, rows_per_owner, topk, blocks, idx.data_ptr(), scores.data_ptr(), idx.shape[0],
                out_idx.data_ptr(), out_scores.data_ptr(), timeout, torch.cuda.current_stream(self.device).cuda_stream,
            )  # fmt: skip

    def unmap(self, mappings: list[SegmentMapping]) -> None:
        """Unmap device memory mapped here (a top-k exchange's slabs) once nothing runs on it."""
        torch.cuda.synchronize(self.device)
        for mapping in mappings:
            mapping.unmap()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    @property
    def service_words(self) -> tuple[int, int]:
        """This rank's service-path words in its own buffer: (input ready, done) addresses."""
        mine = self._buffers[self.rank].address
        return mine + _native.CUDA_SERVICE_READY_OFFSET, mine + _native.CUDA_SERVICE_DONE_OFFSET

    def close(self) -> None:
        torch.cuda.synchronize(self.device)  # nothing may still run on the buffers unmapped below
        self.group = None  # its abort watch stops, and waits for what it wrote
        for mapping in self._buffers:
            mapping.unmap()
