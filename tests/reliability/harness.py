"""What the fuzz suites share: one daemon with short timeouts, calls whose answers are checked,
the daemon's liveness, and the figures the run prints at the end (see conftest.py).

While hunting a bug: FUZZ_NO_SHRINK=1 reports the first failing example as found (shrinking a
slow example can take minutes), FUZZ_COLLECT=<file> appends every unexpected answer to the file
instead of failing at the first.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, settings

from conftest import Daemon, rank_channel
from nodecomm.v1 import control_pb2 as pb
from nodecomm.v1 import control_pb2_grpc as pb_grpc
from waiting import wait_until

# Short timeouts, so that a request that waits for peers who never come costs little; small
# limits, so that huge sizes are refused by the quota instead of taking the machine's memory.
DAEMON_ARGS = [
    "--join-timeout-seconds", "2",
    "--session-grace-seconds", "2",
    "--operation-timeout-seconds", "2",
    "--claim-token-ttl-seconds", "2",
    "--max-capacity-bytes", "16MiB",
    "--max-reserved-bytes", "256MiB",
    "--log-level", "INFO",
]  # fmt: skip


def fuzz(max_examples: int) -> settings:
    """Reproducible in CI: the same examples on every run, no example database written anywhere."""
    return settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        phases=[Phase.explicit, Phase.generate] if os.environ.get("FUZZ_NO_SHRINK") else list(Phase),
    )


# Every status the daemon may answer with. UNKNOWN and INTERNAL mean an unhandled exception;
# UNAVAILABLE and CANCELLED mean the daemon or the stream went away.
ALLOWED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)
MAX_DETAILS = 2000
# What the client's transport says when the daemon's answer could not be delivered as sent.
TRANSPORT_FAILURES = ("metadata size exceeds", "Received RST_STREAM")


@dataclass
class Figures:
    """What the reliability suites tried and found, for the lines the run ends with."""

    calls: Counter = field(default_factory=Counter)  # RPC method -> calls
    outcomes: Counter = field(default_factory=Counter)  # (method, "OK" or status name) -> answers
    garbage_connections: int = 0
    crashes: int = 0
    unexpected: int = 0
    faults: Counter = field(default_factory=Counter)  # fault injected and survived -> times
    load: dict = field(default_factory=dict)  # the load test's figures (test_load.py)
    access: list = field(default_factory=list)  # access-control cases that held
    lock: threading.Lock = field(default_factory=threading.Lock)

    def line(self) -> str:
        return (
            f"fuzz: {sum(self.calls.values())} RPC calls across {len(self.calls)} methods, "
            f"{self.garbage_connections} garbage connections, {self.crashes} daemon crashes, "
            f"{self.unexpected} unexpected status codes"
        )

    def lines(self) -> list[str]:
        """Every suite's figures that ran: fuzzing, faults, load and leaks, access control."""
        out = [self.line()] if self.calls or self.garbage_connections else []
        if self.faults:
            out.append(
                f"faults: {sum(self.faults.values())} injected and survived ({len(self.faults)} kinds: "
                + ", ".join(sorted(self.faults))
                + ")"
            )
        if self.load:
            load = self.load
            out.append(
                f"load: {load['joins_per_second']:.1f} joins/s, {load['operations_per_second']:.0f} operations/s "
                f"beside them, p99 Join {load['p99_join_ms']:.1f} ms, p99 operation {load['p99_operation_us']:.0f} us; "
                f"leaks found {load['leaks']}, results lost or corrupted {load['corrupted']}, "
                f"daemon RSS {load['rss_growth_kib']:+d} KiB"
            )
        if self.access:
            out.append(f"access control: {len(self.access)} cases held ({', '.join(self.access)})")
        return out

    def outcome_lines(self) -> list[str]:
        methods = sorted({method for method, _ in self.outcomes})
        return [
            f"  {method}: "
            + ", ".join(f"{answer} {n}" for (m, answer), n in sorted(self.outcomes.items()) if m == method)
            for method in methods
        ]

    def garbage(self, connections: int = 1) -> None:
        with self.lock:
            self.garbage_connections += connections


FIGURES = Figures()


def start_fuzz_daemon(directory: Path) -> Daemon:
    directory.mkdir(parents=True, exist_ok=True)
    return Daemon(directory, list(DAEMON_ARGS)).start()


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def shown(message: object, limit: int = 1500) -> str:
    """A request as the failure shows it: long strings and lists cut short, so it stays readable."""
    if isinstance(message, Message):
        message = clipped(message)
    text = repr(message)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def clipped(message: Message) -> Message:
    copy = type(message)()
    copy.CopyFrom(message)
    for descriptor, value in copy.ListFields():
        repeated = descriptor.is_repeated
        if descriptor.type == descriptor.TYPE_STRING and not repeated and len(value) > 60:
            setattr(copy, descriptor.name, f"{value[:40]}...{value[-4:]} ({len(value)} characters)")
        elif repeated and len(value) > 8:
            del value[8:]
        if descriptor.type == descriptor.TYPE_MESSAGE:
            for item in value if repeated else [value]:
                item.CopyFrom(clipped(item))
    return copy


class UnexpectedAnswer(AssertionError):
    pass


class Checked:
    """Calls on one channel, each answer checked: success, or an allowed status with a short,
    non-empty message. Counts every call in FIGURES."""

    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.channel = rank_channel(daemon.socket)  # raw calls, with each joined rank's secret
        self.stub = pb_grpc.ControlStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def check_status(self, method: str, error: grpc.RpcError, request: object) -> grpc.StatusCode:
        code, details = error.code(), error.details() or ""
        with FIGURES.lock:
            FIGURES.outcomes[method, code.name] += 1
        problem = None
        if code not in ALLOWED:
            problem = f"status {code.name}"
        elif not details:
            problem = "an empty message"
        elif len(details) >= MAX_DETAILS:
            problem = f"a {len(details)}-character message"
        elif any(text in details for text in TRANSPORT_FAILURES):
            problem = "a transport failure instead of the daemon's answer"
        if problem is not None:
            with FIGURES.lock:
                FIGURES.unexpected += 1
            if os.environ.get("FUZZ_COLLECT"):
                with open(os.environ["FUZZ_COLLECT"], "a") as out:
                    out.write(f"{method} {problem}: {code.name} {details[:300]!r}\n  {shown(request)}\n")
                return code
            raise UnexpectedAnswer(
                f"{method} answered with {problem}: {code.name} {shown(details, 1000)}\nrequest: {shown(request)}"
            )
        return code

    def count(self, method: str, calls: int = 1) -> None:
        with FIGURES.lock:
            FIGURES.calls[method] += calls

    def call(self, method: str, request: object, timeout: float = 5.0) -> object:
        """The reply, or the status code of an allowed refusal."""
        self.count(method)
        try:
            reply = getattr(self.stub, method)(request, timeout=timeout)
        except grpc.RpcError as error:
            return self.check_status(method, error, request)
        self.succeeded(method)
        return reply

    def succeeded(self, method: str) -> None:
        with FIGURES.lock:
            FIGURES.outcomes[method, "OK"] += 1

    def stream(self, method: str, requests: object, timeout: float = 5.0) -> tuple[list, object]:
        """(the messages received, then None on success or the allowed status code)."""
        self.count(method)
        received = []
        try:
            for message in getattr(self.stub, method)(requests, timeout=timeout):
                received.append(message)
        except grpc.RpcError as error:
            return received, self.check_status(method, error, requests)
        self.succeeded(method)
        return received, None

    def assert_alive(self) -> None:
        """The daemon's process runs and its health service says SERVING."""
        process = self.daemon.process
        status = None
        if process.poll() is None:
            try:
                status = self.health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            except grpc.RpcError as error:
                status = error.code()
        if process.poll() is not None or status != health_pb2.HealthCheckResponse.SERVING:
            with FIGURES.lock:
                FIGURES.crashes += 1
            tail = self.daemon.log()[-4000:]
            raise AssertionError(f"daemon not healthy (exit {process.poll()}, health {status}); log tail:\n{tail}")


class SessionStream:
    """A rank's Session stream held open in a thread: `send` puts messages up, `received` holds
    what came down, `close` ends the stream (without Leave: the rank is then lost)."""

    def __init__(self, stub: pb_grpc.ControlStub, group_id: int, rank: int):
        self._up: queue.Queue[pb.SessionUp | None] = queue.Queue()
        self.received: list[pb.SessionDown] = []
        self.error: grpc.RpcError | None = None
        self._up.put(pb.SessionUp(hello=pb.SessionHello(group_id=group_id, rank=rank)))
        self._call = stub.Session(self._messages())
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _messages(self) -> Iterator[pb.SessionUp]:
        while (message := self._up.get()) is not None:
            yield message

    def _read(self) -> None:
        try:
            for message in self._call:
                self.received.append(message)
        except grpc.RpcError as error:
            self.error = error

    def send(self, message: pb.SessionUp) -> None:
        self._up.put(message)

    @property
    def open(self) -> bool:
        return self._thread.is_alive()

    def wait_ready(self, timeout: float = 5.0) -> None:
        wait_until(lambda: any(m.event.kind == pb.READY for m in self.received), timeout, "the session's READY")

    def close(self) -> None:
        self._up.put(None)
        self._thread.join(timeout=10)
