"""The service path from a rank's side: memory the daemon maps too, and collectives it runs.

A ServiceBuffer is memory the daemon allocated and this rank mapped (host memory on CPU groups,
the rank's GPU on CUDA groups); tensors placed in it (`buffer.tensor(...)`) are submitted by
reference. Any other tensor goes through a staging buffer from a small pool: copied in before the
submit, the result copied out when the work is waited on. Submits are numbered per communicator,
in call order, which is how the daemon pairs the ranks' parts of one collective; every rank must
submit its collectives in the same order.

On CUDA groups nothing synchronises the host with the GPU. As the daemon chose when the group
formed (JoinReply.service_ordering), either the current stream raises this rank's "input ready"
word (in its group buffer) to the submit's sequence + 1 once the input is written, and wait()
makes it wait until the "done" word holds the value the daemon's answer names (stream words); or
a submit records an interprocess event on the current stream, and wait() makes it wait on the
daemon's "done" event, whose handle the answer carries (IPC events). The answer comes as soon as
the collective is enqueued; the output is ready when the stream gets there. Submits from several
streams are chained in submit order, so that the words only grow.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass

import grpc
import torch

from nodecomm import _native
from nodecomm.errors import (
    InvalidArgumentError,
    from_rpc_error,
)
from nodecomm.topk_layout import owned_rows
from nodecomm.v1 import control_pb2 as pb
from nodecomm.v1 import control_pb2_grpc as pb_grpc

from .descriptors import DescriptorSocket
from .dtypes import DTYPE_CODES
from .membership import Membership
from .work import Work

# The smallest staging buffer the service path allocates (larger ones double from it): one per rank
# for the small copies of a whole job.
STAGING_MIN_BYTES = 64 << 10
_ALIGN = 64
_HOST = torch.device("cpu")


class _DeviceBytes:
    """Device memory described by __cuda_array_interface__, for torch.as_tensor without a copy."""

    def __init__(self, address: int, size_bytes: int):
        self.__cuda_array_interface__ = {
            "shape": (size_bytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


class ServiceBuffer:
    """Memory shared with the daemon: host memory (CPU groups; tensors from `tensor()` stay valid
    after free(), the mapping lives as long as they do) or memory on the rank's GPU (CUDA groups;
    tensors stay valid until the communicator closes). Freed, it can no longer be submitted."""

    def __init__(self, allocation_id: int, size_bytes: int, base: torch.Tensor, free):
        self.allocation_id = allocation_id
        self.size_bytes = size_bytes
        self._base = base
        self.address = self._base.data_ptr()
        self._free = free
        self.freed = False

    def tensor(self, shape: tuple[int, ...] | int, dtype: torch.dtype, offset_bytes: int = 0) -> torch.Tensor:
        """A contiguous tensor over this buffer's bytes from offset_bytes."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        count = 1
        for extent in shape:
            count *= extent
        nbytes = count * torch.tensor([], dtype=dtype).element_size()
        if offset_bytes < 0 or offset_bytes + nbytes > self.size_bytes or offset_bytes % _ALIGN:
            raise InvalidArgumentError(
                f"{nbytes} bytes at offset {offset_bytes}: expected a 64-byte aligned offset and the range "
                f"inside this {self.size_bytes}-byte buffer"
            )
        return self._base[offset_bytes : offset_bytes + nbytes].view(dtype).view(shape)

    @property
    def device(self) -> torch.device:
        return self._base.device

    def bytes_at(self, offset_bytes: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) as uint8, any offset (staging packs planes back to back)."""
        return self._base[offset_bytes : offset_bytes + nbytes]

    def offset_of(self, tensor: torch.Tensor, nbytes: int) -> int | None:
        """The byte offset of `tensor`'s first `nbytes` in this buffer, or None if they are not inside."""
        if tensor.device != self.device:
            return None
        offset = tensor.data_ptr() - self.address
        return offset if not self.freed and 0 <= offset and offset + nbytes <= self.size_bytes else None

    def free(self) -> None:
        """Give the memory back to the daemon (it unmaps it once no queued collective names it)."""
        if not self.freed:
            self.freed = True
            self._free(self)


@dataclass
class _Staged:
    buffer: ServiceBuffer
    copy_to: list[tuple[torch.Tensor, int]]  # (destination, byte offset in buffer) after the work


class ServiceClient:
    """One rank's use of the service path. Thread-safe."""

    def __init__(
        self,
        stub: pb_grpc.ControlStub,
        membership: Membership,
        descriptor_socket: DescriptorSocket,
        operation_timeout: float,
        metadata: tuple[tuple[str, bytes], ...] = (),
        device: torch.device = _HOST,
        words: tuple[int, int] | None = None,
    ):
        """words: this rank's (input ready, done) word addresses where the group's service path is
        ordered by stream words; None: by IPC events (CUDA) or not at all (CPU)."""
        self._stub = stub
        self._words = words
        self._last_stream: torch.cuda.Stream | None = None  # the stream of the last submit
        self.device = device
        self._ids = dict(group=membership.group, group_id=membership.group_id, rank=membership.rank)
        self._where = membership.where
        self.world_size = membership.world_size
        self._descriptor_socket = descriptor_socket
        self._timeout = operation_timeout
        self._metadata = metadata  # the rank's secret, on every call
        self._lock = threading.Lock()
        self._sequence = 0
        self._buffers: list[ServiceBuffer] = []  # live, the caller's and the staging pool's
        self._idle_staging: list[ServiceBuffer] = []
        # CUDA: device memory mapped here, unmapped at close; events to and from the daemon.
        self._device_mappings: list[tuple[int, int]] = []
        # "Input ready" events free to record: one is reused only once the daemon has answered the
        # submit that last recorded it (its stream then waits on that record, not a later one).
        self._ready_free: list[tuple[torch.cuda.Event, bytes]] = []
        self._done: dict[bytes, torch.cuda.Event] = {}

    # -- memory --------------------------------------------------------------------------------

    def use(self, stub: pb_grpc.ControlStub) -> None:
        """Call the daemon through `stub` from now on (the group was handed to a new daemon)."""
        self._stub = stub

    def allocate(self, size_bytes: int) -> ServiceBuffer:
        try:
            reply = self._stub.AllocateMemory(
                pb.AllocateMemoryRequest(**self._ids, size_bytes=size_bytes),
                timeout=self._timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error, **self._where) from None
        (fd,) = self._descriptor_socket.claim(reply.claim_token, 1, self._timeout, self._where)
        try:
            if self.device.type == "cuda":
                address = _native.cuda_vmm_import(self.device.index, fd, reply.size_bytes)
                with self._lock:
                    self._device_mappings.append((address, reply.size_bytes))
                base = torch.as_tensor(_DeviceBytes(address, reply.size_bytes), device=self.device)
            else:
                base = torch.frombuffer(mmap.mmap(fd, reply.size_bytes), dtype=torch.uint8)
            buffer = ServiceBuffer(reply.allocation_id, reply.size_bytes, base, self._free)
        finally:
            os.close(fd)  # the mapping keeps the memory
        with self._lock:
            self._buffers.append(buffer)
        return buffer

    def _free(self, buffer: ServiceBuffer) -> None:
        with self._lock:
            if buffer in self._buffers:
                self._buffers.remove(buffer)
        try:
            self._stub.FreeMemory(
                pb.FreeMemoryRequest(**self._ids, allocation_id=buffer.allocation_id),
                timeout=self._timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error, **self._where) from None

    def _reference(self, tensor: torch.Tensor, nbytes: int) -> pb.MemoryRef | None:
        with self._lock:
            buffers = list(self._buffers)
        for buffer in buffers:
            offset = buffer.offset_of(tensor, nbytes)
            if offset is not None:
                return pb.MemoryRef(allocation_id=buffer.allocation_id, offset_bytes=offset)
        return None

    def _take_staging(self, nbytes: int) -> ServiceBuffer:
        with self._lock:
            fits = [b for b in self._idle_staging if b.size_bytes >= nbytes]
            if fits:
                buffer = min(fits, key=lambda b: b.size_bytes)
                self._idle_staging.remove(buffer)
                return buffer
        size = STAGING_MIN_BYTES
        while size < nbytes:
            size *= 2
        return self.allocate(size)

    def _finish(self, staged: _Staged | None, reply: pb.SubmitReply | None) -> None:
        """The work's answer is in (None: it failed): on CUDA groups the current stream waits for
        the daemon's "done" word or event; staged outputs are copied out and the staging buffer
        goes back."""
        if reply is not None and self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            if self._words is not None:
                _native.cuda_wait_word(stream.cuda_stream, self._words[1], reply.done_value)
            else:
                self._done_event(reply.done_event).wait(stream)
        if staged is None:
            return
        if reply is None:
            # The daemon may still have work on it queued or running (a CPU collective past the
            # client's deadline included): never reuse it.
            staged.buffer.free()
            return
        for destination, offset in staged.copy_to:
            nbytes = destination.numel() * destination.element_size()
            source = staged.buffer.bytes_at(offset, nbytes)
            destination.view(-1).view(torch.uint8).copy_(source)
        with self._lock:
            self._idle_staging.append(staged.buffer)

    # -- collectives ---------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, out: torch.Tensor) -> Work:
        nbytes = tensor.numel() * tensor.element_size()
        return self._submit(
            pb.ALL_REDUCE, DTYPE_CODES[tensor.dtype], tensor.numel(), 0, [tensor], [out], nbytes, nbytes, out
        )

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor) -> Work:
        nbytes = tensor.numel() * tensor.element_size()
        return self._submit(
            pb.ALL_GATHER, pb.DTYPE_UNSPECIFIED, nbytes, 0, [tensor], [out], nbytes, nbytes * self.world_size, out
        )

    def topk_stage(self, local_idx: torch.Tensor, local_scores: torch.Tensor) -> Work:
        """Submit the exchange of [rows, topk] candidates; the work's result is the owner table."""
        rows, topk = local_idx.shape
        owned = len(owned_rows(rows, self.world_size, self._ids["rank"]))
        idx = torch.empty((owned, self.world_size, topk), dtype=torch.int32, device=self.device)
        scores = torch.empty((owned, self.world_size, topk), dtype=torch.float32, device=self.device)
        plane = rows * topk * 4
        work = self._submit(
            pb.TOPK_STAGE, pb.DTYPE_UNSPECIFIED, rows, topk, [local_idx, local_scores], [idx, scores], 2 * plane,
            2 * owned * self.world_size * topk * 4, (idx, scores),
        )  # fmt: skip
        return work

    def _submit(
        self,
        op: int,
        dtype: int,
        count: int,
        topk: int,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
        in_bytes: int,
        out_bytes: int,
        result=None,
    ) -> Work:
        """Reference the tensors where they lie in service memory (one input and one output
        tensor), else stage them: inputs packed in order, then outputs."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise InvalidArgumentError("the service path cannot be captured in a CUDA graph", **self._where)
        staged = None
        source = self._reference(inputs[0], in_bytes) if len(inputs) == 1 and in_bytes else None
        target = self._reference(outputs[0], out_bytes) if len(outputs) == 1 and out_bytes else None
        if in_bytes and source is None or out_bytes and target is None:
            out_offset = -(-in_bytes // _ALIGN) * _ALIGN
            buffer = self._take_staging(out_offset + out_bytes)
            offset = 0
            for tensor in inputs:
                size = tensor.numel() * tensor.element_size()
                buffer.bytes_at(offset, size).copy_(tensor.reshape(-1).view(torch.uint8))
                offset += size
            source = pb.MemoryRef(allocation_id=buffer.allocation_id, offset_bytes=0)
            target = pb.MemoryRef(allocation_id=buffer.allocation_id, offset_bytes=out_offset)
            copy_to, offset = [], out_offset
            for tensor in outputs:
                copy_to.append((tensor, offset))
                offset += tensor.numel() * tensor.element_size()
            staged = _Staged(buffer, copy_to)
        ready = self._record_ready() if self.device.type == "cuda" and self._words is None else None
        with self._lock:
            sequence = self._sequence
            self._sequence += 1
            if self._words is not None:
                self._raise_ready_word(sequence + 1)
        request = pb.SubmitRequest(
            ready_event=ready[1] if ready is not None else b"",
            ready_value=sequence + 1 if self._words is not None else 0,
            **self._ids,
            sequence=sequence,
            op=op,
            dtype=dtype,
            count=count,
            topk=topk,
            input=source,
            output=target,
            timeout_seconds=self._timeout,
        )
        future = self._stub.Submit.future(request, timeout=self._timeout + 5.0, metadata=self._metadata)
        if ready is not None:
            future.add_done_callback(lambda _: self._release_ready(ready))
        return Work(future, lambda reply: self._finish(staged, reply), self._where, self._timeout + 10.0, result)

    def _raise_ready_word(self, value: int) -> None:
        """Enqueue on the current stream: this rank's "input ready" word := value. A stream other
        than the last submit's first waits for that one's work, so the word never goes down.
        Called with the lock held, so that values are written in sequence order."""
        stream = torch.cuda.current_stream(self.device)
        if self._last_stream is not None and self._last_stream != stream:
            stream.wait_stream(self._last_stream)
        self._last_stream = stream
        _native.cuda_write_word(stream.cuda_stream, self._words[0], value)

    def _record_ready(self) -> tuple[torch.cuda.Event, bytes]:
        """Record a free "input ready" event on the current stream: (event, its IPC handle)."""
        with self._lock:
            ready = self._ready_free.pop() if self._ready_free else None
        if ready is None:
            event = torch.cuda.Event(interprocess=True)
            event.record(torch.cuda.current_stream(self.device))  # created on its first record
            ready = (event, event.ipc_handle())
        ready[0].record(torch.cuda.current_stream(self.device))
        return ready

    def _release_ready(self, ready: tuple[torch.cuda.Event, bytes]) -> None:
        with self._lock:
            self._ready_free.append(ready)

    def _done_event(self, handle: bytes) -> torch.cuda.Event:
        with self._lock:
            event = self._done.get(handle)
            if event is None:
                event = self._done[handle] = torch.cuda.Event.from_ipc_handle(self.device, handle)
        return event

    def empty_submit(self) -> Work:
        """A collective with nothing to move: what one submit costs on the control plane."""
        return self._submit(pb.ALL_REDUCE, pb.FLOAT32, 0, 0, [], [], 0, 0)

    def close(self) -> None:
        """Forget the buffers; the daemon frees them with the group. Host tensors keep their
        mappings; device memory is unmapped once this GPU's work is done."""
        with self._lock:
            for buffer in self._buffers:
                buffer.freed = True
            self._buffers.clear()
            self._idle_staging.clear()
            mappings, self._device_mappings = self._device_mappings, []
        if mappings:
            torch.cuda.synchronize(self.device)
            for address, size in mappings:
                _native.cuda_vmm_unmap(address, size)
