"""The service path on CUDA groups: the memory is on the ranks' GPUs and nothing waits on the
host. The daemon's stream on the group's executing GPU waits until every rank's input is written,
runs the collective, and marks it done; the ranks' streams wait for that. Two orderings, chosen
when the group forms:

    stream words  each rank's stream raises the "input ready" word in its own group buffer to the
                  submit's sequence + 1; the daemon's stream waits for every rank's word, and after
                  the collective raises every rank's "done" word, which the rank's stream waits on
                  (native/cuda/stream_words.h). Nothing but the buffers' descriptors is shared.
    IPC events    each submit carries an event the rank recorded; the daemon's stream waits on
                  every rank's and records a "done" event whose handle answers the ranks. The
                  handles need a /dev/shm shared between the daemon and the ranks.

An abort holds every rank's "input ready" word past any sequence until the daemon's stream has
run out what it was given instead of waiting on a rank that is gone, and each rank raises its own
"done" word (native/cuda/abort_watch.h); the group's buffers are unmapped only once the stream is
idle.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from nodecomm import _native
from nodecomm.errors import NodecommError
from nodecomm.service.memory.allocator import RankAllocation
from nodecomm.service.service_path.parts import Part
from nodecomm.v1 import control_pb2 as pb

log = logging.getLogger("nodecomm.submissions")


class CudaExecution:
    """A CUDA group's service path on the device: the daemon's stream on the group's executing
    GPU, the ranks' "input ready" events (opened once each), and a ring of "done" events. Every
    call runs on the group's one worker thread, so enqueueing, unmapping and closing stay in order
    and a stream waiting on a rank never holds up the event loop."""

    def __init__(self, device: int, ring: int, timeout: float, rank_buffers: list[int] | None = None):
        """rank_buffers: the daemon's address of every rank's group buffer, for stream words;
        None: IPC events."""
        self.device = device
        self.ordering = pb.STREAM_WORDS if rank_buffers is not None else pb.IPC_EVENTS
        self._rank_buffers = rank_buffers or []
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

    def run(self, sequence: int, parts: list[Part]) -> pb.SubmitReply:
        """Enqueue collective `sequence` after every part's input is ready; the reply that tells the
        ranks what to wait for."""
        if self._stream is None:
            self._start()
        ready = _native.CUDA_SERVICE_READY_OFFSET
        for rank, part in enumerate(parts):
            if self.ordering == pb.STREAM_WORDS:
                _native.cuda_wait_word(self._stream, self._rank_buffers[rank] + ready, part.request.ready_value)
                continue
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
        if self.ordering == pb.STREAM_WORDS:
            for buffer in self._rank_buffers:
                _native.cuda_write_word(self._stream, buffer + _native.CUDA_SERVICE_DONE_OFFSET, sequence + 1)
            return pb.SubmitReply(sequence=sequence, done_value=sequence + 1)
        event, handle = self._done[sequence % self._ring]
        _native.cuda_event_record(self.device, event, self._stream)
        return pb.SubmitReply(sequence=sequence, done_event=handle)

    def _start(self) -> None:
        stream = _native.cuda_stream_create(self.device)
        done: list[tuple[int, bytes]] = []
        try:
            for _ in range(self._ring if self.ordering == pb.IPC_EVENTS else 0):
                done.append(_native.cuda_ipc_event_create(self.device))
        except NodecommError:
            for event, _ in done:
                _native.cuda_event_destroy(event)
            _native.cuda_stream_destroy(stream)
            raise
        self._stream, self._done = stream, done

    def release(self) -> None:
        """The group aborted: hold every rank's "input ready" word past any sequence until the
        stream has run out what it was given. Held, not written once: a killed rank's stream can
        still run a write it had queued while the driver tears its context down, which would lower
        the word again under a wait the stream has yet to reach."""
        if self._rank_buffers and not self._closing:
            self.thread.submit(self._hold_released)

    def _hold_released(self) -> None:
        if not self._idle(while_busy=self._release_words):
            log.error("a released CUDA service stream stayed busy")

    def _release_words(self) -> None:
        for buffer in self._rank_buffers:
            _native.cuda_write_word_now(
                self.device, buffer + _native.CUDA_SERVICE_READY_OFFSET, _native.CUDA_SERVICE_RELEASED
            )

    def unmap_later(self, address: int, size_bytes: int) -> None:
        """Unmap memory the stream may still wait on (a group buffer) once it is idle."""
        with self._lock:
            self._unmaps.append((address, size_bytes))
            if self._closed:
                self._unmap_freed()
            elif not self._closing:
                self.thread.submit(self._sync_and_unmap)

    def unmap(self, allocation: RankAllocation) -> None:
        """Unmap a freed allocation once the stream has run everything enqueued before now."""
        os.close(allocation.fd)
        self.unmap_later(allocation.address, allocation.size_bytes)

    def _idle(self, while_busy: Callable[[], None] = lambda: None) -> bool:
        """Whether the stream has run all it was given, polled up to `timeout` (calling
        `while_busy` before each look): it may wait on a rank whose stream never gets to its
        word or event (a rank that died)."""
        deadline = time.monotonic() + self.timeout
        try:
            while_busy()
            while self._stream is not None and not _native.cuda_stream_idle(self.device, self._stream):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.01)
                while_busy()
        except NodecommError as error:
            log.error("a CUDA service stream failed", extra={"error": str(error)})
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
