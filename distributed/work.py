"""Work: what a nodecomm process group returns for each operation, as torch.distributed expects.

An operation finishes in one of three ways, and the Work records which:
- on the calling thread, before the Work is returned (CPU operations that were not asked to run
  asynchronously): nothing to wait for;
- on a node group's worker thread (asynchronous CPU operations, every send and recv): `done` is the
  concurrent future the worker completes, with the operation's error if it failed;
- enqueued on a CUDA stream: `event` is recorded on that stream after the operation, and wait()
  makes the caller's current stream wait on it, without blocking the host, as NCCL's Work does.
"""

from __future__ import annotations

import concurrent.futures
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from nodecomm.errors import DeadlineExceededError, InvalidArgumentError


class Work(dist.Work):
    def __init__(
        self,
        result: list[torch.Tensor],
        *,
        done: concurrent.futures.Future | None = None,
        stream: torch.cuda.Stream | None = None,
        event: torch.cuda.Event | None = None,
    ):
        super().__init__()
        self._result = result
        self._done = done
        self._stream = stream
        self._event = event
        self._future: torch.futures.Future | None = None
        self.source: int | None = None  # a receive's sender, once known

    def source_rank(self) -> int:
        """The rank a receive took its data from (a receive from any source: -1 until it completes)."""
        if self.source is None:
            raise InvalidArgumentError("source_rank(): this Work is not a completed receive")
        return self.source

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Return once the operation is complete as seen from the current stream (CUDA: the
        current stream waits on the operation; the host does not, unless given a timeout: then it
        waits at most that long for the operation, as NCCL's Work does), or raise its error."""
        seconds = timeout.total_seconds() if timeout else None
        deadline = None if seconds is None else time.monotonic() + seconds
        self._host_result(deadline, seconds)
        if self._event is not None:
            while deadline is not None and not self._event.query():
                if time.monotonic() >= deadline:
                    raise DeadlineExceededError(f"the operation did not finish within wait()'s {seconds:.3f} s")
                time.sleep(0.0001)
            torch.cuda.current_stream(self._event.device).wait_event(self._event)
        return True

    def _host_result(self, deadline: float | None = None, seconds: float | None = None) -> None:
        """Wait for the operation (until `deadline`, a time.monotonic(), if one is given), then
        raise its error, if it had one."""
        if self._done is None:
            return
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        finished, _ = concurrent.futures.wait([self._done], timeout=left)
        if not finished:
            raise DeadlineExceededError(f"the operation did not finish within wait()'s {seconds:.3f} s")
        self._done.result()

    @property
    def on_stream(self) -> bool:
        """Whether a CUDA stream orders the operation (as it orders a native CUDA all-reduce)."""
        return self._event is not None

    def is_completed(self) -> bool:
        if self._done is not None and not self._done.done():
            return False
        return self._event is None or self._event.query()

    def is_success(self) -> bool:
        """False once the operation failed (as torch's Works: true while it runs)."""
        return self.exception() is None

    def exception(self) -> BaseException | None:
        if self._done is None or not self._done.done():
            return None
        return _error_of(self._done)

    def result(self) -> list[torch.Tensor]:
        self._host_result()
        return self._result

    def synchronize(self) -> None:
        """Block the host until the operation is complete, on the device too."""
        self._host_result()
        if self._event is not None:
            self._event.synchronize()

    def get_future(self) -> torch.futures.Future:
        """A torch Future completed with the operation's outputs, or failed with its error. On CUDA
        it is a device-aware future: waiting on it makes the current stream wait for the operation.
        A failure is the error of a then() callback, the one kind torch's C++ future holds as an
        error: set_exception() only keeps it as the value (with a Python unwrap that the C++
        backend's callers, such as DDP's comm hooks, never see)."""
        if self._future is None:
            devices = [self._stream.device] if self._stream is not None else []
            done = torch.futures.Future(devices=devices)
            if self._done is None:
                self._future = done
                self._complete(done)
            else:  # on a node group's worker: its outputs once it ends, or its error raised
                self._future = done.then(self._outputs)
                self._done.add_done_callback(lambda _: self._complete(done))
        return self._future

    def _outputs(self, done: torch.futures.Future) -> list[torch.Tensor]:
        error = _error_of(self._done)
        if error is not None:
            raise error
        return done.value()

    def _complete(self, future: torch.futures.Future) -> None:
        if self._stream is not None:
            # The future records its events on the current stream: make that the operation's.
            with torch.cuda.stream(self._stream):
                future.set_result(self._result)
        else:
            future.set_result(self._result)


def _error_of(done: concurrent.futures.Future) -> BaseException | None:
    try:
        return done.exception()
    except concurrent.futures.CancelledError as cancelled:  # dropped at a shutdown before it ran
        return cancelled
