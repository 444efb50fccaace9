"""A peer SIGKILLed or SIGSTOPped while the other rank replays a captured graph (an all-reduce, the
fused norm and a top-k stage; dist.all_reduce of init_process_group("nodecomm"); vLLM's capture
sequence), ranks sharing the GPU: the survivor's process ends with the one line (the default), or,
under "log", check() raises and the daemon counts it; no stale output passes check()."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import signal
import time

import pytest

import replay_ranks
from conftest import free_port
from nodecomm.captured_abort import EXIT_STATUS

pytestmark = pytest.mark.gpu

TIMEOUT_S = replay_ranks.TIMEOUT_S


def run(make_daemon, spawn_ranks, tmp_path, how: str, sig: int, policy: str):
    daemon = make_daemon(
        "--allow-shared-devices", "true", "--operation-timeout-seconds", str(TIMEOUT_S), "--captured-abort", policy
    )
    report = mp.get_context("spawn").Queue()
    port = free_port()
    stderr = [tmp_path / f"stderr-{rank}" for rank in range(2)]
    ranks = [
        spawn_ranks(
            replay_ranks.replay_until_abort, [rank], 2, daemon.socket, port, how, str(stderr[rank]), report, timeout=240
        )  # fmt: skip
        for rank in range(2)
    ]
    running: list[int] = []
    deadline = time.monotonic() + 180
    while len(running) < 2:  # a rank that failed to start ends the test at once, not after 180 s
        dead = {n: r.results()[n] for n, r in enumerate(ranks) if r.processes[n].exitcode is not None}
        assert not dead and time.monotonic() < deadline, dead  # a traceback where a rank raised
        with contextlib.suppress(queue.Empty):
            running.append(report.get(timeout=1))
    # Both replaying, in step: each reported after its third replay, synchronised.
    signalled = time.monotonic()
    ranks[1].kill(1, sig)
    try:
        ranks[0].processes[0].join(60)  # ended, or returned under "log"
        took = time.monotonic() - signalled
        result = ranks[0].results()[0]
    finally:
        ranks[1].kill(1, signal.SIGKILL)
    text = stderr[0].read_text()
    lines = [line for line in text.splitlines() if line.startswith("nodecomm: ")]
    print(f"{how} {signal.Signals(sig).name} {policy}: {result} after {took:.2f} s; {lines}")
    assert "silent stale output" not in text, text
    return daemon, result, lines, took


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("how", ["comm", "distributed", "vllm"])
def test_the_survivor_ends_with_one_line(make_daemon, spawn_ranks, tmp_path, how, sig):
    daemon, result, lines, took = run(make_daemon, spawn_ranks, tmp_path, how, sig, "exit")
    assert result == ("died", EXIT_STATUS), result
    (line,) = lines
    reason = "peer rank 1 was lost" if sig == signal.SIGKILL else "rank 0 timed out waiting for rank 1"
    assert line.startswith("nodecomm: [group '") and f"rank 0] group aborted: {reason}; " in line, line
    assert line.endswith(
        f"ending the process (exit status {EXIT_STATUS}; NODECOMM_CAPTURED_ABORT=log keeps it running)"
    )
    # A stopped peer is found out when the replay's wait runs out, not before; a killed one when its
    # session ends, at once.
    assert took > TIMEOUT_S - 0.5 if sig == signal.SIGSTOP else took < TIMEOUT_S, took


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_under_the_log_policy_check_raises_and_the_daemon_counts_it(make_daemon, spawn_ranks, tmp_path, sig):
    daemon, (status, outcome), lines, _ = run(make_daemon, spawn_ranks, tmp_path, "comm", sig, "log")
    assert status == "ok" and outcome["silent"] == 0 and outcome["error"][0] == "PeerLostError", outcome
    (line,) = lines
    assert line.endswith("Communicator.check() raises (NODECOMM_CAPTURED_ABORT=log)"), line
    reason = "peer_lost" if sig == signal.SIGKILL else "stalled"
    deadline = time.monotonic() + 10
    while f'nodecomm_captured_group_aborts_total{{reason="{reason}"}} 1.0' not in daemon.metrics_text():
        assert time.monotonic() < deadline, daemon.metrics_text()
        time.sleep(0.1)
