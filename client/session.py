"""The rank's Session: its stream with the daemon while the group lives, run on a background thread.

Down the stream come group events and new tables (kept as offers until the ranks agree to
switch); up go batches of sampled timings and operation counts. If the stream breaks after
the daemon accepted it while the communicator is open, the daemon is gone: the group runs on
without it on its peer paths, unless it needs the daemon (legacy CUDA IPC buffers, a table with a
service range), when the session sets the group's abort word (so peers spinning in a barrier stop
too) and the next call raises DaemonUnavailableError. A stream the daemon refuses at the start
keeps its status.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from nodecomm import _native
from nodecomm.errors import (
    AlreadyExistsError,
    DaemonUnavailableError,
    DeadlineExceededError,
    InternalError,
    NodecommError,
    NotFoundError,
    PermissionDeniedError,
    UnsupportedError,
    from_rpc_error,
    shown,
)
from nodecomm.thresholds import DispatchTable, Path, Wire
from nodecomm.v1 import control_pb2 as pb
from nodecomm.v1 import control_pb2_grpc as pb_grpc

from .dispatch import PATH_CODES, WIRE_CODES
from .membership import Membership

log = logging.getLogger("nodecomm.client")

_BATCH = 32
_FLUSH_SECONDS = 1.0
# The most timings one message carries. The daemon ends a session whose message holds more than
# 256 (service/calibration/timings.py); the native lanes hold up to 4,096 between flushes (a burst of native
# calls that reach no Python), and what is past the newest of them is older than live tables need.
_MAX_TIMINGS_PER_MESSAGE = 128
# Batches waiting to be sent past which new ones are dropped: the daemon reads a session at a
# bounded pace, and a rank that samples faster loses samples rather than memory.
_MAX_QUEUED_BATCHES = 256
# How often a rank whose daemon is gone tries to hand its group to the next one while none
# answers; the answers after which it stops trying (the daemon serving there will not take this
# group); and, after any other answer (a limit this daemon sets, a request it will not take as
# it is), the longest wait between tries: each such answer doubles the wait up to it, well under
# the daemons' session grace (10 s by default) that its peers' hand-over starts.
_RETRY_SECONDS = 0.1
_REFUSALS = (PermissionDeniedError, UnsupportedError, AlreadyExistsError, NotFoundError)
_MAX_RETRY_SECONDS = 2.0


class Session:
    def __init__(
        self,
        stub: pb_grpc.ControlStub,
        membership: Membership,
        control_address: int,
        counts: _native.Dispatch,
        metadata: tuple[tuple[str, bytes], ...] = (),
        needs_daemon: Callable[[], str | None] = lambda: None,
        reattach: Callable[[int], pb_grpc.ControlStub] | None = None,
    ):
        self._group = membership.group
        self._stub = stub
        self._group_id = membership.group_id
        self._rank = membership.rank
        self._control = control_address
        self._metadata = metadata
        # Why the group cannot run on without its daemon, when the session is lost (None: it can).
        self._needs_daemon = needs_daemon
        # Hands the group to the daemon serving the socket now (Communicator._reattach), given the
        # calls made while none did; returns the stub to open the session with there.
        self._reattach = reattach
        self._closed = threading.Event()
        self.adoptions = 0  # times this rank's group was handed to a new daemon
        self._outbox: queue.SimpleQueue[pb.SessionUp | None] = queue.SimpleQueue()
        # Operations per (op, path, wire) and sampled timings, kept natively by every call.
        self._counts = counts
        self._batch_lock = threading.Lock()  # the caller's thread may flush, and the stream's thread
        self._last_flush = time.monotonic()
        self._dropping = False  # batches are being dropped (warned once per episode)
        self._ready = threading.Event()
        self._closing = False
        self.lost_reason: str | None = None  # why the daemon is unusable, once it is
        self.refusal: NodecommError | None = None  # the daemon's answer if it refused the session
        self.event_message: str | None = None  # the last group event's message
        self.offered: dict[int, DispatchTable] = {}  # tables the daemon pushed, by epoch
        # Those a lost daemon pushed: the ranks may still switch to one every rank offered before
        # the loss, but none is offered again, since a peer may never have received it and the
        # next daemon numbers its own tables past them (service/calibration/tables.py).
        self.withheld: set[int] = set()
        self._call = None
        self._thread = threading.Thread(target=self._run, name=f"nodecomm-session-{membership.rank}", daemon=True)

    def start(self, timeout: float) -> None:
        """Open the stream and wait for READY. Raises the daemon's refusal, or TimeoutError."""
        self._outbox.put(pb.SessionUp(hello=pb.SessionHello(group_id=self._group_id, rank=self._rank)))
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the daemon did not accept the session within {timeout:.1f} s")
        if self.refusal is not None:
            raise self.refusal
        if self.lost_reason is not None:
            raise ConnectionError(self.lost_reason)

    def _requests(self, outbox: queue.SimpleQueue) -> Iterator[pb.SessionUp]:
        """What goes up one stream (gRPC reads it on a thread of its own): `outbox`'s messages until
        its None, which _stream puts there once the stream is over, and, while the rank is quiet, a
        batch about once a second."""
        while True:
            try:
                message = outbox.get(timeout=_FLUSH_SECONDS)
            except queue.Empty:
                # A rank gone quiet still reports what it did, about once a second.
                batch = self._take_batch()
                if batch is not None:
                    yield batch
                continue
            if message is None:
                return
            yield message

    def _run(self) -> None:
        """The session's stream; where it is lost and the group runs on, the group is handed to the
        next daemon on the socket (service/groups/adoption.py) and the stream opened there, as often as
        that happens, until the communicator closes."""
        self._stream()
        while self.lost_reason is not None and not self._closing and self._reattach is not None:
            if self._control_aborted():
                return
            stub = self._reattached()
            if stub is None or self._closing:
                return
            self._stub = stub
            self.adoptions += 1
            outbox: queue.SimpleQueue[pb.SessionUp | None] = queue.SimpleQueue()
            outbox.put(pb.SessionUp(hello=pb.SessionHello(group_id=self._group_id, rank=self._rank)))
            self._outbox = outbox  # the lost stream's reader may still hold the old one
            self.lost_reason = None
            self._stream()

    def _control_aborted(self) -> bool:
        return _native.abort_state(self._control)[0] != 0

    def _reattached(self) -> pb_grpc.ControlStub | None:
        """The stub of the next daemon once it has taken the group, trying every _RETRY_SECONDS
        while none answers and less often after a daemon's "not now" (the calls go on meanwhile);
        None when the communicator closes, the group aborts, or a daemon refuses it for good
        (logged: the group runs on without one)."""
        calls_at_loss = self._counts.calls
        where = {"group": self._group, "rank": self._rank}
        wait, answered = _RETRY_SECONDS, ""
        while not self._closed.wait(wait):
            if self._control_aborted():
                return None
            try:
                return self._reattach(self._counts.calls - calls_at_loss)
            except _REFUSALS as error:  # this daemon will not take the group, now or later
                log.warning(
                    f"[group {shown(self._group)}, rank {self._rank}] the daemon serving now did not take the "
                    f"group: {error}; it runs on without one",
                    extra={**where, "error": str(error)},
                )
                return None
            except (DaemonUnavailableError, DeadlineExceededError, ConnectionError, OSError) as error:
                # Nothing serves yet, or a daemon starting or leaving: try again soon.
                wait = _RETRY_SECONDS
                log.debug("no daemon took the group yet", extra={**where, "error": str(error)})
            except NodecommError as error:
                # A daemon serves and said no for now: ask it again less and less often, and say why
                # once (until the answer changes): an operator may lift the limit, or start another.
                wait = min(wait * 2, _MAX_RETRY_SECONDS)
                if str(error) != answered:
                    answered = str(error)
                    log.warning(
                        f"[group {shown(self._group)}, rank {self._rank}] the daemon serving now turned the group "
                        f"away: {error}; it runs on without one and asks again every {_MAX_RETRY_SECONDS:g} s "
                        "at most",
                        extra={**where, "error": answered},
                    )
        return None

    def _stream(self) -> None:
        outbox = self._outbox
        try:
            self._call = self._stub.Session(self._requests(outbox), metadata=self._metadata)
            for message in self._call:
                if message.WhichOneof("kind") == "thresholds":
                    self.take_offer(DispatchTable.from_proto(message.thresholds))
                    continue
                if message.event.kind == pb.READY:
                    self._ready.set()
                else:
                    self.event_message = message.event.message
                    if message.event.kind == pb.DRAINING:
                        self.lost_reason = "the daemon is shutting down"
            if not self._closing and self.lost_reason is None:
                self.lost_reason = "the daemon ended this rank's session"
        except grpc.RpcError as error:
            if not self._ready.is_set():
                self.refusal = from_rpc_error(error, rank=self._rank)
            elif not self._closing:
                self.lost_reason = f"the daemon connection was lost ({error.code().name}: {error.details()})"
        except Exception as error:  # a message this client cannot read: the session is over all the same
            if not self._ready.is_set():
                self.refusal = InternalError(
                    f"the daemon's session message could not be read: {error!r}", rank=self._rank
                )
            elif not self._closing:
                self.lost_reason = f"the daemon's session message could not be read: {error!r}"
        finally:
            if not self._closing and self.refusal is None:
                self.withheld.update(list(self.offered))
                # The group runs on where it can: its ranks hold its memory, and its peer paths need
                # no daemon. A daemon that wants a group gone aborts it (its abort word) before it
                # ends a session. Where it cannot, this rank aborts it, for every rank (the word is
                # shared). The message names everything: under Python's default logging only it is printed.
                why = self._needs_daemon()
                if self._control_aborted():  # a peer left or was lost meanwhile: nothing to hand on
                    outcome = "the group was aborted"
                elif why is not None:
                    _native.abort_group(self._control, _native.AbortReason.DAEMON_LOST, self._rank)
                    outcome = f"the group is aborted: {why}"
                else:
                    outcome = (
                        "the group runs on without the daemon (peer paths; no service path, table moves or timings) "
                        "and is handed to the next one on the socket"
                    )
                log.warning(
                    f"[group {shown(self._group)}, rank {self._rank}] session lost: {self.lost_reason}; {outcome}",
                    extra={"group": self._group, "rank": self._rank, "reason": self.lost_reason},
                )
            outbox.put(None)  # this stream's request thread ends (gRPC's, waiting on its outbox)
            self._ready.set()

    def take_offer(self, table: DispatchTable) -> None:
        """Keep a table the daemon pushed as an offer, not used: the ranks switch together
        (Communicator._agree_on_table). Not in place of one this rank holds under its epoch: a
        lost daemon's, which the ranks may still agree on, as a peer holds it (a daemon that
        adopted the group from a rank that never received it can number a table of its own so)."""
        held = self.offered.setdefault(table.epoch, table)
        if held != table:
            log.info(
                "a table pushed under an epoch this rank holds another table under is not taken",
                extra={"group": self._group, "rank": self._rank, "epoch": table.epoch},
            )

    def report(self, path: int, nbytes: int, seconds: float, wire: int = 0) -> None:
        """One timed call on `path` over `wire` (nodecomm.v1 codes); a CPU group's all-reduces keep
        theirs natively (native/host_lane.h), sent with the next batch."""
        held = self._counts.record(path, wire, nbytes, seconds)
        if held >= _BATCH or time.monotonic() - self._last_flush > _FLUSH_SECONDS:
            self.flush()

    def count(
        self, op: int, path: Path, nbytes: int, wire: Wire = Wire.LOSSLESS, wire_bytes: int | None = None
    ) -> None:
        """One call of `op` (pb.Op) on `path` moving `nbytes` of this rank's payload, which took
        `wire_bytes` (default: nbytes) on `wire`. (all_reduce counts through the native Dispatch.)"""
        sent = nbytes if wire_bytes is None else wire_bytes
        self._counts.count(op, PATH_CODES[path], WIRE_CODES[wire], nbytes, sent)
        if time.monotonic() - self._last_flush > _FLUSH_SECONDS:
            self.flush()

    def _take_batch(self) -> pb.SessionUp | None:
        """The timings (the newest _MAX_TIMINGS_PER_MESSAGE) and counts not sent yet, as one message
        (None if there are none)."""
        if self.lost_reason is not None:
            return None
        with self._batch_lock:
            self._last_flush = time.monotonic()
            counts = [
                pb.OperationCount(op=op, path=path, operations=n, bytes=nbytes, wire=wire, wire_bytes=sent)
                for op, path, wire, n, nbytes, sent in self._counts.take_counts()
            ]
            timings = [
                pb.Timing(path=path, bytes=nbytes, seconds=seconds, wire=wire)
                for path, wire, nbytes, seconds in self._counts.take_samples()[-_MAX_TIMINGS_PER_MESSAGE:]
            ]
            captured = [pb.CapturedSize(bytes=nbytes, path=path) for nbytes, path in self._counts.take_captured()]
        if not timings and not counts and not captured:
            return None
        return pb.SessionUp(timings=pb.TimingBatch(timings=timings, counts=counts, captured=captured))

    def flush_if_full(self) -> None:
        """Send the timings not sent yet once there is a batch of them (the hot path keeps them
        natively; the daemon's live recalibration is only as quick as they reach it)."""
        if self._counts.held() >= _BATCH:
            self.flush()

    def flush(self) -> None:
        """Send the timings and counts not sent yet; while no daemon serves they wait (natively:
        every count, the newest timings) for the next."""
        batch = self._take_batch()
        if batch is None:
            return
        if self._outbox.qsize() >= _MAX_QUEUED_BATCHES:
            if not self._dropping:
                log.warning(
                    f"[group {shown(self._group)}, rank {self._rank}] timings are sampled faster than the daemon "
                    "reads them: dropping batches while it catches up (raise the daemon's timing_sample_period)",
                    extra={"group": self._group, "rank": self._rank},
                )
            self._dropping = True
            return
        self._dropping = False
        self._outbox.put(batch)

    def close(self, timeout: float = 5.0) -> None:
        if self._closing:
            return
        self._closing = True
        self._closed.set()
        self.flush()
        self._outbox.put(None)  # half-close: the daemon takes the last timings, then ends the stream
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive() and self._call is not None:
            self._call.cancel()
            self._thread.join(timeout)
