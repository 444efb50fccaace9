"""How a communicator runs what its native lane leaves to Python (barriers, gathers, top-k stages)
on its transport: under the call lock that close() takes, on a group checked usable, errors
located; a captured call recorded for the capture watch (native/capture_watch.h)."""

from __future__ import annotations

from collections.abc import Callable

from nodecomm import _native
from nodecomm.errors import NodecommError

from .transport import Transport


class TransportRuns:
    def __init__(
        self,
        transport: Transport,
        control_address: int,
        rank: int,
        lock: _native.CallLock,
        check_usable: Callable[..., None],
        located: Callable[[NodecommError], NodecommError],
    ):
        self._transport = transport
        self._control_address = control_address
        self._rank = rank
        self._lock = lock
        self._check_usable = check_usable
        self._located = located

    def run(self, operation, *args) -> None:
        """Run `operation(*args)`."""
        with self._lock:
            self._check_usable(call_follows=True)
            capturing = self._transport.capturing()
            try:
                operation(*args)
            except NodecommError as error:
                raise self._located(error) from None
            if capturing:  # a graph holds it: an abort is watched for
                _native.record_captured(self._control_address, self._rank)
