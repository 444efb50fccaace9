"""How a communicator runs what its native lane leaves to Python (NCCL, barriers, gathers, top-k
stages) on its transport: under the call lock that close() takes, on a group checked usable,
errors located; a sampled call timed by the transport's events and reported to the daemon once
they have completed; a captured call recorded for the capture watch (native/capture_watch.h)."""

from __future__ import annotations

from collections.abc import Callable

from nodecomm import _native
from nodecomm.errors import NodecommError
from nodecomm.thresholds import Path

from .dispatch import PATH_CODES
from .session import Session
from .transport import Transport

NCCL = PATH_CODES[Path.NCCL]


class TransportRuns:
    def __init__(
        self,
        transport: Transport,
        session: Session,
        control_address: int,
        rank: int,
        lock: _native.CallLock,
        check_usable: Callable[..., None],
        located: Callable[[NodecommError], NodecommError],
    ):
        self._transport = transport
        self._session = session
        self._control_address = control_address
        self._rank = rank
        self._lock = lock
        self._check_usable = check_usable
        self._located = located
        self._samples: list[tuple[int, int, int, object, object]] = []  # started, not yet reported

    def run(self, operation, *args, sample: tuple[int, int, int] | None = None, capturing: bool | None = None) -> None:
        """Run `operation(*args)`; with `sample` (path code, bytes, wire code), timed. `capturing`:
        whether the stream captures, where the caller knows."""
        with self._lock:
            self._check_usable(call_follows=True)
            # Nothing is timed or queried while a CUDA graph is being captured.
            if capturing is None:
                capturing = self._transport.capturing()
            timed = sample is not None and not capturing
            start = self._transport.mark() if timed else None
            try:
                operation(*args)
            except NodecommError as error:
                raise self._located(error) from None
            if capturing:  # a graph holds it: an abort is watched for
                _native.record_captured(self._control_address, self._rank)
            if timed:
                self._samples.append((*sample, start, self._transport.mark()))
            if self._samples and not capturing:
                self._report()

    def nccl_all_reduce(self, tensor, out, sampled: bool, capturing: bool, timeout: float) -> None:
        """An all-reduce the lane decided for NCCL, which the transport runs (on the engine's group)."""
        sample = (NCCL, tensor.nbytes, 0) if sampled else None
        self.run(self._transport.all_reduce, tensor, out, NCCL, timeout, sample=sample, capturing=capturing)

    def _report(self) -> None:
        while self._samples:
            path, nbytes, wire, start, end = self._samples[0]
            seconds = self._transport.elapsed(start, end)
            if seconds is None:
                return  # still running; reported on a later call
            self._samples.pop(0)
            self._session.report(path, nbytes, seconds, wire)
