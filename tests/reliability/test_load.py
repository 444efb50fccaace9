"""Load and leaks: groups that form, work and leave while others all-reduce without pause, against
one daemon; afterwards its descriptors, memfds, mappings and memory must be back at baseline."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from conftest import Daemon

from . import load_ranks
from .harness import FIGURES

SECONDS = 20.0


def daemon_resources(pid: int) -> dict[str, int]:
    """What the daemon holds: open descriptors, memfds among them, memfd mappings, resident KiB."""
    targets = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            targets.append(str(fd.readlink()))
        except OSError:
            pass  # closed between listing and reading
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    rss = int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1))
    return {
        "fds": len(targets),
        "memfds": sum("/memfd:" in t for t in targets),
        "memfd_mappings": sum("/memfd:" in line for line in maps),
        "rss_kib": rss,
    }


def settle(daemon: Daemon, pid: int, baseline: dict[str, int], timeout: float = 30.0) -> dict[str, int]:
    """The daemon's resources once every group is released (or the timeout passes)."""
    deadline = time.monotonic() + timeout
    while True:
        now = daemon_resources(pid)
        if all(now[k] <= baseline[k] for k in ("fds", "memfds", "memfd_mappings")) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


@pytest.fixture
def load_daemon(tmp_path):
    daemon = Daemon(tmp_path, ["--log-level", "WARNING"]).start()
    try:
        yield daemon
    finally:
        daemon.stop(signal.SIGKILL)


def test_load_holds_and_nothing_leaks(load_daemon, spawn_ranks):
    daemon, pid = load_daemon, load_daemon.process.pid
    # Warm up every kind of request once, so that lazily created threads and pools are in the baseline.
    spawn_ranks(load_ranks.churn, 2, 2, daemon.socket, "warm", 0.0, timeout=120).values()
    baseline = settle(daemon, pid, daemon_resources(pid))

    steady = spawn_ranks(load_ranks.steady, 2, 2, daemon.socket, "steady", SECONDS, timeout=300)
    churners = [spawn_ranks(load_ranks.churn, 2, 2, daemon.socket, f"churn{i}", SECONDS, timeout=300) for i in range(2)]
    steady_results = steady.values()
    churn_results = [c.values() for c in churners]

    after = settle(daemon, pid, baseline)
    joins = sum(r["joins"] for results in churn_results for r in results.values())
    join_seconds = max(r["seconds"] for results in churn_results for r in results.values())
    ops = steady_results[0]["ops"]
    figures = {
        "joins_per_second": joins / join_seconds,
        "operations_per_second": ops / steady_results[0]["seconds"],
        "p99_join_ms": 1e3 * max(r["p99_join"] for results in churn_results for r in results.values()),
        "p99_operation_us": 1e6 * max(r["p99_op"] for r in steady_results.values()),
        "corrupted": sum(r["corrupted"] for r in steady_results.values())
        + sum(r["corrupted"] for results in churn_results for r in results.values()),
        "leaks": sum(after[k] > baseline[k] for k in ("fds", "memfds", "memfd_mappings")),
        "rss_growth_kib": after["rss_kib"] - baseline["rss_kib"],
    }
    FIGURES.load = figures
    assert figures["corrupted"] == 0
    # Back at (or below: idle connections close) the baseline: nothing leaked.
    assert after["fds"] <= baseline["fds"] and after["memfds"] <= baseline["memfds"], (baseline, after)
    assert after["memfd_mappings"] <= baseline["memfd_mappings"], (baseline, after)
    # Python's allocator keeps some of what it freed; a leak per group would be far larger.
    assert figures["rss_growth_kib"] < 64 << 10, (baseline, after, figures)
    assert joins >= 10 and ops >= 100 and baseline["fds"] > 0, (figures, baseline)
    assert daemon.healthy()
