"""A CUDA group through daemon restarts (ranks sharing the GPU): eager all-reduces and replays of
a graph captured before the first restart go on, exact, through a SIGTERM and a SIGKILL of the
daemon, and each next daemon adopts the group; the VMM buffers outlive the daemon that made them."""

import multiprocessing as mp
import signal
import time

import pytest

import restart_ranks
from waiting import wait_until

pytestmark = pytest.mark.gpu


def test_eager_calls_and_graph_replays_ride_through_a_sigterm_and_a_sigkill(make_daemon, spawn_ranks):
    daemon = make_daemon("--allow-shared-devices", "true")
    context = mp.get_context("spawn")
    report, commands = context.Queue(), [context.Queue() for _ in range(2)]
    group = spawn_ranks(restart_ranks.ride_through_on_cuda, 2, 2, daemon.socket, report, commands, timeout=300)
    assert sorted(report.get(timeout=120) for _ in range(2)) == [("running", 0), ("running", 1)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        daemon.stop(sig)
        time.sleep(0.5)  # not a wait: no daemon serves for this long, the ranks calling on
        daemon.start()
        # The ranks come back to the next daemon, which takes their group over.
        wait_until(
            lambda: (
                {"nodecomm_adopted_groups_total 1.0", "nodecomm_ranks 2.0"} <= set(daemon.metrics_text().splitlines())
            ),
            60,
            daemon.log,
        )
    for queue in commands:
        queue.put("stop")
    outcomes = group.values()
    print(outcomes)
    for outcome in outcomes.values():
        assert outcome["failed"] == 0 and outcome["wrong"] == 0 and outcome["steps"] > 10, outcome
        assert outcome["adoptions"] == 2, outcome
    assert "group adopted" in daemon.log()
