"""Faults on CUDA groups: a rank stopped or killed at each stage (joining, mapped and idle, inside
a collective, inside a top-k stage, with service submits in flight), ranks sharing the GPU where
there is one. The CPU suite's rank programs and checks (tests/reliability/test_faults.py), run
with device="cuda": the survivor gets an error naming rank 1 within its timeout, the daemon keeps
serving, and the name forms again."""

from __future__ import annotations

import signal

import pytest

from conftest import Daemon
from reliability import fault_ranks
from reliability.test_faults import DAEMON_ARGS, stop_or_kill_at

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
    stop_or_kill_at(cuda_fault_daemon, spawn_ranks, stage, sig, "cuda")
