"""Sizes probed before capture: inside Communicator.capture() (what an engine's graph_capture()
enters), each size's warm-up call times its lossless paths in CUDA graphs; every rank captures the
fastest, the replays are exact, and the daemon shows each captured size beside its table's path. A
fused all_reduce_rms_norm's warm-up probes its size too, and its captured calls take that path."""

import json
import multiprocessing as mp
import subprocess
import sys

import pytest

import cuda_ranks
from waiting import wait_until

pytestmark = pytest.mark.gpu

# bf16 elements: 1 KiB, 16 KiB, 256 KiB, 1 MiB, 4 MiB and 64 MiB.
COUNTS = [512, 8192, 131072, 524288, 2097152, 33554432]
NORM = (3, 4096)  # rows, hidden: 24 KiB of bf16, a size no all-reduce above probes


def test_every_rank_captures_the_path_its_probe_chose_and_replays_exactly(make_daemon, spawn_ranks):
    daemon = make_daemon("--allow-shared-devices", "true", "--operation-timeout-seconds", "60")
    context = mp.get_context("spawn")
    report, commands = context.Queue(), [context.Queue() for _ in range(2)]
    group = spawn_ranks(cuda_ranks.probed_captures, 2, 2, daemon.socket, COUNTS, NORM, report, commands, timeout=600)
    for _ in range(2):
        assert report.get(timeout=500) == "sent"

    def captured() -> dict:
        status = subprocess.run(
            [sys.executable, "-m", "nodecomm.tools.cli", "--socket", daemon.socket, "status", "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        (shown,) = [g for g in json.loads(status.stdout)["groups"] if g["name"] == "probed"]
        return {c["bytes"]: c["path"] for c in shown["captured"]}

    shown = wait_until(captured, timeout=30, what="the captured sizes reach the daemon")
    for queue in commands:
        queue.put("stop")
    results = group.values()
    assert results[0]["problems"] == [] and results[1]["problems"] == [], results
    chosen = results[0]["chosen"]
    assert sorted(chosen) == sorted(2 * c for c in [*COUNTS, NORM[0] * NORM[1]]), results
    assert results[1]["chosen"] == chosen, results  # the ranks agree on every size
    assert shown == chosen, (shown, chosen)


def test_a_probe_beside_another_threads_capture_breaks_neither(make_daemon, spawn_ranks):
    daemon = make_daemon("--allow-shared-devices", "true", "--operation-timeout-seconds", "60")
    count = 8192  # 16 KiB of bf16
    results = spawn_ranks(cuda_ranks.probed_beside_another_capture, 2, 2, daemon.socket, count, timeout=300).values()
    assert results[0]["problems"] == [] and results[1]["problems"] == [], results
    assert list(results[0]["chosen"]) == [2 * count], results  # the probe ran, on every rank alike
    assert results[1]["chosen"] == results[0]["chosen"], results
