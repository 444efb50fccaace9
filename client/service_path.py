"""The service path from a rank's side: memory the daemon maps too, and collectives it runs.

A ServiceBuffer is host memory the daemon allocated and this rank mapped; tensors placed in it
(`buffer.tensor(...)`) are submitted by reference. Any other tensor goes through a staging buffer
from a small pool: copied in before the submit, the result copied out when the work is waited on.
Submits are numbered per communicator, in call order, which is how the daemon pairs the ranks'
parts of one collective; every rank must submit its collectives in the same order.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass

import grpc
import torch

from nodecomm.errors import DaemonUnavailableError, InvalidArgumentError, NodecommError, from_rpc_error
from nodecomm.topk_layout import owned_rows
from nodecomm.v1 import control_pb2 as pb
from nodecomm.v1 import control_pb2_grpc as pb_grpc

from .descriptors import claim
from .dtypes import DTYPE_CODES

_STAGING_MIN_BYTES = 64 << 10
_ALIGN = 64


class ServiceBuffer:
    """Host memory shared with the daemon. Tensors from `tensor()` stay valid after free() (the
    mapping lives as long as they do), but can no longer be submitted."""

    def __init__(self, allocation_id: int, size_bytes: int, fd: int, free):
        self.allocation_id = allocation_id
        self.size_bytes = size_bytes
        self._base = torch.frombuffer(mmap.mmap(fd, size_bytes), dtype=torch.uint8)
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

    def offset_of(self, tensor: torch.Tensor, nbytes: int) -> int | None:
        """The byte offset of `tensor`'s first `nbytes` in this buffer, or None if they are not inside."""
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


class ServiceWork:
    """A submitted collective. wait() returns its result (the output tensor, or the owner table's
    (idx, scores)) once the daemon has run it, or raises its error."""

    def __init__(self, future: grpc.Future | None, on_done, where: dict, timeout: float, result=None):
        self._future = future
        self._on_done = on_done
        self._where = where
        self._timeout = timeout
        self._result = result
        self._error: NodecommError | None = None
        self._finished = future is None

    @classmethod
    def completed(cls, result) -> ServiceWork:
        """The work of a call that finished before it returned."""
        return cls(None, lambda ok: None, {}, 0.0, result)

    def done(self) -> bool:
        return self._finished or self._future.done()

    def wait(self):
        if not self._finished:
            try:
                self._future.result(timeout=self._timeout)
            except grpc.RpcError as error:
                self._error = from_rpc_error(error, **self._where)
            except grpc.FutureTimeoutError:
                self._future.cancel()
                self._error = DaemonUnavailableError(
                    f"the daemon did not answer a submit within {self._timeout:.1f} s", **self._where
                )
            finally:
                self._finished = True
                self._on_done(self._error is None)
        if self._error is not None:
            raise self._error
        return self._result


class ServicePath:
    """One rank's use of the service path. Thread-safe."""

    def __init__(
        self,
        stub: pb_grpc.ControlStub,
        group: str,
        group_id: int,
        rank: int,
        world_size: int,
        descriptor_socket: str,
        operation_timeout: float,
        metadata: tuple[tuple[str, bytes], ...] = (),
    ):
        self._stub = stub
        self._ids = dict(group=group, group_id=group_id, rank=rank)
        self._where = dict(group=group, rank=rank)
        self.world_size = world_size
        self._descriptor_socket = descriptor_socket
        self._timeout = operation_timeout
        self._metadata = metadata  # the rank's secret, on every call
        self._lock = threading.Lock()
        self._sequence = 0
        self._buffers: list[ServiceBuffer] = []  # live, the caller's and the staging pool's
        self._idle_staging: list[ServiceBuffer] = []

    # -- memory --------------------------------------------------------------------------------

    def allocate(self, size_bytes: int) -> ServiceBuffer:
        try:
            reply = self._stub.AllocateMemory(
                pb.AllocateMemoryRequest(**self._ids, size_bytes=size_bytes),
                timeout=self._timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error, **self._where) from None
        (fd,) = claim(self._descriptor_socket, reply.claim_token, 1, self._timeout, self._where)
        try:
            buffer = ServiceBuffer(reply.allocation_id, reply.size_bytes, fd, self._free)
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
        size = _STAGING_MIN_BYTES
        while size < nbytes:
            size *= 2
        return self.allocate(size)

    def _give_back(self, staged: _Staged | None, ok: bool) -> None:
        if staged is None:
            return
        if ok:
            for destination, offset in staged.copy_to:
                nbytes = destination.numel() * destination.element_size()
                source = staged.buffer.tensor(nbytes, torch.uint8, offset)
                destination.view(-1).view(torch.uint8).copy_(source)
        with self._lock:
            self._idle_staging.append(staged.buffer)

    # -- collectives ---------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, out: torch.Tensor) -> ServiceWork:
        nbytes = tensor.numel() * tensor.element_size()
        return self._submit(
            pb.ALL_REDUCE, DTYPE_CODES[tensor.dtype], tensor.numel(), 0, [tensor], [out], nbytes, nbytes, out
        )

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor) -> ServiceWork:
        nbytes = tensor.numel() * tensor.element_size()
        return self._submit(
            pb.ALL_GATHER, pb.DTYPE_UNSPECIFIED, nbytes, 0, [tensor], [out], nbytes, nbytes * self.world_size, out
        )

    def topk_stage(self, local_idx: torch.Tensor, local_scores: torch.Tensor) -> ServiceWork:
        """Submit the exchange of [rows, topk] candidates; the work's result is the owner table."""
        rows, topk = local_idx.shape
        owned = len(owned_rows(rows, self.world_size, self._ids["rank"]))
        idx = torch.empty((owned, self.world_size, topk), dtype=torch.int32)
        scores = torch.empty((owned, self.world_size, topk), dtype=torch.float32)
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
    ) -> ServiceWork:
        """Reference the tensors where they lie in service memory (one input and one output
        tensor), else stage them: inputs packed in order, then outputs."""
        staged = None
        source = self._reference(inputs[0], in_bytes) if len(inputs) == 1 and in_bytes else None
        target = self._reference(outputs[0], out_bytes) if len(outputs) == 1 and out_bytes else None
        if in_bytes and source is None or out_bytes and target is None:
            out_offset = -(-in_bytes // _ALIGN) * _ALIGN
            buffer = self._take_staging(out_offset + out_bytes)
            offset = 0
            for tensor in inputs:
                size = tensor.numel() * tensor.element_size()
                buffer.tensor(size, torch.uint8, offset).copy_(tensor.reshape(-1).view(torch.uint8))
                offset += size
            source = pb.MemoryRef(allocation_id=buffer.allocation_id, offset_bytes=0)
            target = pb.MemoryRef(allocation_id=buffer.allocation_id, offset_bytes=out_offset)
            copy_to, offset = [], out_offset
            for tensor in outputs:
                copy_to.append((tensor, offset))
                offset += tensor.numel() * tensor.element_size()
            staged = _Staged(buffer, copy_to)
        with self._lock:
            sequence = self._sequence
            self._sequence += 1
        request = pb.SubmitRequest(
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
        return ServiceWork(future, lambda ok: self._give_back(staged, ok), self._where, self._timeout + 10.0, result)

    def empty_submit(self) -> ServiceWork:
        """A collective with nothing to move: what one submit costs on the control plane."""
        return self._submit(pb.ALL_REDUCE, pb.FLOAT32, 0, 0, [], [], 0, 0)

    def close(self) -> None:
        """Forget the buffers; the daemon frees them with the group, tensors keep their mappings."""
        with self._lock:
            for buffer in self._buffers:
                buffer.freed = True
            self._buffers.clear()
            self._idle_staging.clear()
