"""Faults on CUDA groups: a rank stopped or killed at each stage (joining, mapped and idle, inside
a collective, inside a top-k stage, with service submits in flight), ranks sharing the GPU where
there is one. The CPU suite's rank programs and checks (tests/reliability/test_faults.py), run
with device="cuda": the survivor gets an error naming rank 1 within its timeout, the daemon keeps
serving, and the name forms again."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time

import pytest
from reliability import fault_ranks
from reliability.test_faults import DAEMON_ARGS, OPERATION_TIMEOUT, survivor_only

from conftest import Daemon

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_fault_daemon(tmp_path_factory):
    daemon = Daemon(tmp_path_factory.mktemp("cuda-faults"), [*DAEMON_ARGS, "--allow-shared-devices", "true"]).start()
    try:
        yield daemon
    finally:
        daemon.stop(signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["SIGSTOP", "SIGKILL"])
@pytest.mark.parametrize("stage", fault_ranks.STAGES)
def test_a_cuda_rank_stopped_or_killed_at_each_stage(cuda_fault_daemon, spawn_ranks, stage, sig):
    context = mp.get_context("spawn")
    report, signalled = context.Queue(), context.Queue()
    group = f"cuda-fault-{stage}-{sig.name}"
    ranks = spawn_ranks(
        fault_ranks.work_until_error, 2, 2, cuda_fault_daemon.socket, group, stage, report, signalled, "cuda",
        timeout=180,
    )  # fmt: skip
    assert {report.get(timeout=120)[1] for _ in range(2)} == {0, 1}
    time.sleep(0.3)
    ranks.kill(1, sig)
    signalled.put(time.time())
    status, value = ranks.results()[0] if sig == signal.SIGKILL else survivor_only(ranks)
    assert status == "ok", value
    name, message, waited = value
    assert name in ("PeerLostError", "DeadlineExceededError"), (name, message)
    assert "rank 1" in message or "ranks [1]" in message, message
    assert waited < 5.0 + OPERATION_TIMEOUT + 3.0, (waited, message)
    if sig == signal.SIGSTOP:
        ranks.kill(1, signal.SIGKILL)
    again = spawn_ranks(fault_ranks.reform, 2, 2, cuda_fault_daemon.socket, group, "cuda", timeout=120).values()
    assert again == {0: 3.0, 1: 3.0}
    assert cuda_fault_daemon.healthy()
