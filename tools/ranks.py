"""Rank processes started together, and what each one returns, against one deadline.

The benches and the tests run their ranks here: rank r is `target(r, *args)` in a process of its
own (spawned: nothing of the parent's CUDA or gRPC state crosses over). What it returns, or the
exception it raised, comes back over one queue; a rank that exits without a word is reported as
died. A rank may also send parts on the way (`report=True`: the target gets a `Report` after its
arguments), which the parent hands to `on_part` as they come.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket as socketlib
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

# How long a rank that exited is given for its last message to arrive before it counts as died.
_LAST_WORD_S = 1.0


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (for a rank group's store)."""
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RanksFailed(RuntimeError):
    """Ranks raised, died, or did not finish; the message has every such rank's traceback."""


@dataclass(frozen=True)
class Report:
    """A rank's way to send a part before its result."""

    queue: mp.Queue
    rank: int

    def __call__(self, payload: object) -> None:
        self.queue.put((self.rank, "part", payload))


def _rank_entry(target: Callable, rank: int, args: tuple, results: mp.Queue, report: bool) -> None:
    # Ctrl-C reaches the whole process group; the parent answers it and ends the ranks, so a rank
    # does not print a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        value = target(rank, *args, Report(results, rank)) if report else target(rank, *args)
        results.put((rank, "ok", value))
    except BaseException as error:  # reported to the parent, which decides
        results.put((rank, "error", (type(error).__name__, str(error), traceback.format_exc())))


@dataclass
class RankProcesses:
    """Processes, one per rank, whose results `results()` waits for until `deadline`."""

    processes: dict[int, mp.Process]
    queue: mp.Queue
    deadline: float
    _dead_since: dict[int, float] = field(default_factory=dict)

    @classmethod
    def start(
        cls, target: Callable, ranks: int | list[int], *args: object, timeout: float = 120.0, report: bool = False
    ) -> RankProcesses:
        """`target(rank, *args)` for each of `ranks` (a count, or the rank numbers), each within
        `timeout` seconds; with `report`, `target(rank, *args, Report)`."""
        context = mp.get_context("spawn")
        results = context.Queue()
        numbers = list(range(ranks)) if isinstance(ranks, int) else ranks
        processes = {
            r: context.Process(target=_rank_entry, args=(target, r, args, results, report), daemon=True)
            for r in numbers
        }
        started = cls(processes, results, time.monotonic() + timeout)
        try:
            for process in processes.values():
                process.start()
        except BaseException:
            started.close()
            raise
        return started

    def __enter__(self) -> RankProcesses:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def results(
        self, on_part: Callable[[object], None] | None = None, first_failure: bool = False
    ) -> dict[int, tuple[str, object]]:
        """Every rank's (status, value): ("ok", what it returned), ("error", (type, message,
        traceback)) or ("died", exit code). With `first_failure`, the first rank that raised or died
        raises RanksFailed at once instead of the others being waited for."""
        collected: dict[int, tuple[str, object]] = {}
        while len(collected) < len(self.processes):
            remaining = self.deadline - time.monotonic()
            try:
                rank, status, value = self.queue.get(timeout=min(max(0.1, remaining), 0.5))
            except queue.Empty:
                if remaining <= 0:
                    missing = sorted(set(self.processes) - set(collected))
                    raise RanksFailed(f"ranks {missing} did not finish before the deadline") from None
                now = time.monotonic()
                for r, process in self.processes.items():
                    if r not in collected and process.exitcode is not None:
                        if now - self._dead_since.setdefault(r, now) > _LAST_WORD_S:
                            collected[r] = ("died", process.exitcode)
                            if first_failure:
                                raise RanksFailed(describe({r: collected[r]})) from None
                continue
            if status == "part":
                if on_part is not None:
                    on_part(value)
                continue
            collected[rank] = (status, value)
            if first_failure and status != "ok":
                raise RanksFailed(describe({rank: collected[rank]}))
        return collected

    def values(self, on_part: Callable[[object], None] | None = None, first_failure: bool = False) -> dict[int, object]:
        """Every rank's return value; RanksFailed with every failed rank's traceback otherwise (the
        first to fail is not always the cause)."""
        collected = self.results(on_part, first_failure)
        failures = {rank: result for rank, result in collected.items() if result[0] != "ok"}
        if failures:
            raise RanksFailed(describe(failures))
        return {rank: value for rank, (_, value) in sorted(collected.items())}

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        os.kill(self.processes[rank].pid, sig)

    def close(self, grace: float = 0.0) -> None:
        """Waits up to `grace` seconds for the ranks to exit, then kills those still running."""
        deadline = time.monotonic() + grace
        for process in self.processes.values():
            if process.pid is not None:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes.values():
            if process.is_alive():
                process.kill()
        for process in self.processes.values():
            if process.pid is not None:
                process.join(timeout=10)


def describe(failures: dict[int, tuple[str, object]]) -> str:
    """One paragraph per failed rank: how it failed, with its traceback where it raised."""
    lines = []
    for rank, (status, value) in sorted(failures.items()):
        detail = value[2] if status == "error" and isinstance(value, tuple) else f"exit code {value}"
        lines.append(f"rank {rank} {status}: {detail}")
    return "\n".join(lines)
