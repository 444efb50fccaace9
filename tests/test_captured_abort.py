"""A group that aborts while CUDA graphs hold a rank's calls is made loud without a nodecomm call
(nodecomm.captured_abort): one line on stderr naming the group, the rank and the reason, then the
process ends (the default), or, under "log", Communicator.check() raises; the daemon counts it and
names the group. CPU ranks stand in for captured ones (tests/ranks.py, hold_captured_group): the
watch and the process ending are the same code. With real graphs on a GPU:
tests/gpu/test_captured_abort_cuda.py."""

import multiprocessing as mp
import signal
import time
from pathlib import Path

import pytest

import nodecomm
import ranks
from nodecomm.captured_abort import EXIT_STATUS
from nodecomm.service.config import DaemonConfig
from waiting import wait_until

LINE_START = "nodecomm: [group 'captured', rank 0] group aborted: "


class CapturedGroup:
    """The ranks of hold_captured_group, each a process of its own, all running (after="reduce":
    all-reducing in step); `stderr[r]` is rank r's stderr."""

    def __init__(self, spawn_ranks, socket: str, directory: Path, world_size: int = 2, job_policy: str = "",
                 after: str = "check"):  # fmt: skip
        report = mp.get_context("spawn").Queue()
        self.stderr = {rank: directory / f"stderr-{rank}" for rank in range(world_size)}
        self.ranks = [
            spawn_ranks(
                ranks.hold_captured_group, [rank], world_size, socket, str(self.stderr[rank]), job_policy, after, report
            )
            for rank in range(world_size)
        ]  # fmt: skip
        assert sorted(report.get(timeout=60) for _ in range(world_size)) == list(range(world_size))

    def signal(self, rank: int, sig: int) -> None:
        self.ranks[rank].kill(rank, sig)

    def result(self, rank: int) -> tuple[str, object]:
        return self.ranks[rank].results()[rank]

    def lines(self, rank: int) -> list[str]:
        return [line for line in self.stderr[rank].read_text().splitlines() if line.startswith("nodecomm: ")]


def test_a_lost_peer_ends_the_process_whose_graphs_hold_the_group(daemon, spawn_ranks, tmp_path):
    group = CapturedGroup(spawn_ranks, daemon.socket, tmp_path)
    group.signal(1, signal.SIGKILL)
    assert group.result(0) == ("died", EXIT_STATUS), group.stderr[0].read_text()
    (line,) = group.lines(0)
    assert line == (
        LINE_START + "peer rank 1 was lost; 1 captured calls of this group now replay without their result: "
        f"ending the process (exit status {EXIT_STATUS}; NODECOMM_CAPTURED_ABORT=log keeps it running)"
    )
    assert 'nodecomm_captured_group_aborts_total{reason="peer_lost"} 1.0' in daemon.metrics_text()
    assert (
        "captured group 'captured' aborted: rank 1's session ended without Leave; CUDA graphs of ranks [0, 1]"
        in daemon.log()
    )


def test_a_stopped_peer_ends_it_once_the_wait_times_out(make_daemon, spawn_ranks, tmp_path):
    daemon = make_daemon("--operation-timeout-seconds", "2")
    group = CapturedGroup(spawn_ranks, daemon.socket, tmp_path, after="reduce")  # both all-reducing, in step
    signalled = time.monotonic()
    group.signal(1, signal.SIGSTOP)
    try:
        assert group.result(0) == ("died", EXIT_STATUS), group.stderr[0].read_text()
        assert time.monotonic() - signalled > 1.5  # the wait ran out: it was not over before the stop
        (line,) = group.lines(0)
        assert line.startswith(LINE_START + "rank 0 timed out waiting for a peer; 1 captured calls"), line
    finally:
        group.signal(1, signal.SIGKILL)
    # The daemon saw the word rank 0 set (GroupRegistry.notice_aborts), whoever ended first.
    wait_until(
        lambda: 'nodecomm_captured_group_aborts_total{reason="stalled"} 1.0' in daemon.metrics_text(),
        10,
        lambda: daemon.metrics_text(),
    )


def test_a_lost_daemon_ends_nothing_and_a_peer_lost_without_it_still_ends_the_process(
    make_daemon, spawn_ranks, tmp_path
):
    """The group runs on without its daemon: the daemon's death ends no process; a peer that dies
    afterwards is found when rank 0's next wait runs out (the group's 2 s), which ends rank 0."""
    daemon = make_daemon("--operation-timeout-seconds", "2")
    group = CapturedGroup(spawn_ranks, daemon.socket, tmp_path, after="reduce")
    daemon.stop(signal.SIGKILL)
    time.sleep(1.5)  # not a wait: nothing may end for this long (the watches look every 20 ms)
    for rank in (0, 1):
        assert group.ranks[rank].processes[rank].exitcode is None, group.stderr[rank].read_text()
        assert group.lines(rank) == []
    killed = time.monotonic()
    group.signal(1, signal.SIGKILL)
    assert group.result(0) == ("died", EXIT_STATUS), group.stderr[0].read_text()
    assert time.monotonic() - killed < 2 + 5  # the timeout, and scheduling on a busy machine
    (line,) = group.lines(0)
    assert line.startswith(LINE_START + "rank 0 timed out waiting for a peer; 1 captured calls"), line


@pytest.mark.parametrize(
    ("daemon_policy", "job_policy", "ends"),
    [("log", "", False), ("exit", "log", False), ("log", "exit", True)],
    ids=["daemon-log", "job-log-over-daemon-exit", "job-exit-over-daemon-log"],
)
def test_the_job_policy_wins_over_the_daemon_policy(make_daemon, spawn_ranks, tmp_path, daemon_policy, job_policy,
                                                    ends):  # fmt: skip
    daemon = make_daemon("--captured-abort", daemon_policy)
    group = CapturedGroup(spawn_ranks, daemon.socket, tmp_path, job_policy=job_policy)
    group.signal(1, signal.SIGKILL)
    status, value = group.result(0)
    (line,) = group.lines(0)
    assert line.startswith(LINE_START + "peer rank 1 was lost; 1 captured calls"), line
    if ends:
        assert (status, value) == ("died", EXIT_STATUS)
        return
    # Logged, not ended: the process goes on and check() raises, in the daemon's words.
    assert line.endswith("Communicator.check() raises (NODECOMM_CAPTURED_ABORT=log)"), line
    assert (status, value) == (
        "ok",
        ("PeerLostError", "[group 'captured', rank 0] group aborted: rank 1's session ended without Leave"),
    )
    assert 'nodecomm_captured_group_aborts_total{reason="peer_lost"} 1.0' in daemon.metrics_text()


def test_the_aborted_group_is_named_while_a_rank_replays_it(make_daemon, spawn_ranks, tmp_path):
    daemon = make_daemon("--captured-abort", "log")
    group = CapturedGroup(spawn_ranks, daemon.socket, tmp_path, world_size=3)
    named = 'nodecomm_captured_aborted_groups{group="captured"} 1.0'
    group.signal(2, signal.SIGKILL)
    wait_until(lambda: named in daemon.metrics_text(), 30, lambda: daemon.metrics_text())
    assert group.result(0)[1][0] == "PeerLostError"
    group.signal(1, signal.SIGKILL)
    # Gone with the group's last rank.
    wait_until(lambda: "nodecomm_captured_aborted_groups{" not in daemon.metrics_text(), 30, daemon.metrics_text)


def test_a_peer_that_leaves_ends_nothing(daemon, spawn_ranks, tmp_path):
    """An orderly end (Leave, as an engine shutting down) is no failure: the survivor is told only
    once a kernel of its own stops without its result after it, which no CPU call does."""
    group = CapturedGroup(spawn_ranks, daemon.socket, tmp_path, after="leave")
    assert group.result(0) == ("ok", ("PeerLostError", "[group 'captured', rank 0] group closed: peer rank 1 left"))
    assert group.lines(0) == []
    assert "nodecomm_captured_group_aborts_total{" not in daemon.metrics_text()


def test_a_bad_job_policy_is_refused_at_connect(daemon, monkeypatch):
    monkeypatch.setenv("NODECOMM_CAPTURED_ABORT", "abort")
    with pytest.raises(
        nodecomm.InvalidArgumentError, match=r"NODECOMM_CAPTURED_ABORT='abort': expected 'exit' or 'log'"
    ):
        nodecomm.connect("bad", 0, 1, socket=daemon.socket, timeout=10)


def test_a_bad_daemon_policy_is_refused():
    with pytest.raises(ValueError, match=r"captured_abort: expected 'exit' or 'log', got 'abort'"):
        DaemonConfig(captured_abort="abort")
