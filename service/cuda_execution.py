"""The service path on CUDA groups: the memory is on the ranks' GPUs and nothing waits on the
host. Each submit carries an event the rank recorded once its input was written; the daemon's
stream on the group's executing GPU waits on every rank's, runs the collective, and records a
"done" event whose handle answers every rank once it is enqueued; the ranks' streams wait on it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from nodecomm import _native
from nodecomm.errors import NodecommError
from nodecomm.v1 import control_pb2 as pb

from .allocator import RankAllocation

if TYPE_CHECKING:
    from .submissions import Part

log = logging.getLogger("nodecomm.submissions")


class CudaExecution:
    """A CUDA group's service path on the device: the daemon's stream on the group's executing
    GPU, the ranks' "input ready" events (opened once each), and a ring of "done" events. Every
    call runs on the group's one worker thread, so enqueueing, unmapping and closing stay in order
    and a stream waiting on a rank never holds up the event loop."""

    def __init__(self, device: int, ring: int, timeout: float):
        self.device = device
        self.timeout = timeout  # how long unmapping waits for the stream before it gives up
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="nodecomm-cuda-service")
        self._stream: int | None = None
        self._opened: dict[bytes, int] = {}
        self._done: list[tuple[int, bytes]] = []
        self._ring = ring
        self._lock = threading.Lock()
        self._unmaps: list[tuple[int, int]] = []  # (address, size) freed, to unmap once the stream is idle
        self._closing = False
        self._closed = False

    def run(self, sequence: int, parts: list[Part]) -> bytes:
        """Enqueue collective `sequence` after every part's ready event; the done event's handle."""
        if self._stream is None:
            stream = _native.cuda_stream_create(self.device)
            done: list[tuple[int, bytes]] = []
            try:
                for _ in range(self._ring):
                    done.append(_native.cuda_ipc_event_create(self.device))
            except NodecommError:
                for event, _ in done:
                    _native.cuda_event_destroy(event)
                _native.cuda_stream_destroy(stream)
                raise
            self._stream, self._done = stream, done
        for part in parts:
            handle = part.request.ready_event
            if handle not in self._opened:
                self._opened[handle] = _native.cuda_ipc_event_open(self.device, handle)
            _native.cuda_stream_wait_event(self.device, self._stream, self._opened[handle])
        first = parts[0].request
        inputs = [p.input[1] if p.input is not None else 0 for p in parts]
        outputs = [p.output[1] if p.output is not None else 0 for p in parts]
        if first.count:
            if first.op == pb.ALL_REDUCE:
                _native.cuda_service_all_reduce(self.device, inputs, outputs, first.count, first.dtype, self._stream)
            elif first.op == pb.ALL_GATHER:
                _native.cuda_service_all_gather(self.device, inputs, outputs, first.count, self._stream)
            else:
                _native.cuda_service_topk_stage(self.device, inputs, outputs, first.count, first.topk, self._stream)
        event, handle = self._done[sequence % self._ring]
        _native.cuda_event_record(self.device, event, self._stream)
        return handle

    def unmap(self, allocation: RankAllocation) -> None:
        """Unmap a freed allocation once the stream has run everything enqueued before now."""
        os.close(allocation.fd)
        with self._lock:
            self._unmaps.append((allocation.address, allocation.size_bytes))
            if self._closed:  # the stream is gone, and with it all work on this memory
                self._unmap_freed()
            elif not self._closing:
                self.thread.submit(self._sync_and_unmap)
            # else: the queued _close unmaps it

    def _idle(self) -> bool:
        """Whether the stream has run all it was given, polled up to `timeout`: it may wait on a
        rank whose stream never gets to its event (a rank that died)."""
        deadline = time.monotonic() + self.timeout
        try:
            while self._stream is not None and not _native.cuda_stream_idle(self.device, self._stream):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.01)
        except NodecommError as error:
            log.error("querying a CUDA service stream failed", extra={"error": str(error)})
            return False
        return True

    def _sync_and_unmap(self) -> None:
        if not self._idle():
            # Memory the stream may still touch stays mapped (a leak, not a fault); tried again at close.
            log.error("a CUDA service stream stayed busy; freed memory stays mapped for now")
            return
        with self._lock:
            self._unmap_freed()

    def _unmap_freed(self) -> None:
        for address, size in self._unmaps:
            try:
                _native.cuda_vmm_unmap(address, size)
            except NodecommError as error:
                log.error("unmapping a service allocation failed", extra={"error": str(error)})
        self._unmaps.clear()

    def close(self) -> None:
        """Once the stream has run its work: unmap what was freed, destroy the stream and events,
        end the thread. Allocations freed later are unmapped at once."""
        with self._lock:
            self._closing = True
        self.thread.submit(self._close)
        self.thread.shutdown(wait=False)

    def _close(self) -> None:
        if not self._idle():
            log.error("a CUDA service stream stayed busy at close; its memory and events are left as they are")
            return
        try:
            for event in [*self._opened.values(), *(e for e, _ in self._done)]:
                _native.cuda_event_destroy(event)
            if self._stream is not None:
                _native.cuda_stream_destroy(self._stream)
        except NodecommError as error:
            log.error("closing a CUDA service path failed", extra={"error": str(error)})
        with self._lock:
            self._closed = True
            self._unmap_freed()
