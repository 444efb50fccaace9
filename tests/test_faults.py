"""Faults: a killed rank, a stalled peer, a daemon restart, a drain. Nothing may hang."""

import ctypes
import multiprocessing as mp
import platform
import re
import signal
from pathlib import Path

import grpc
import pytest

import ranks
from conftest import kill_at_work
from nodecomm import _native
from nodecomm.socket_path import grpc_target
from nodecomm.v1 import control_pb2 as pb
from nodecomm.v1 import control_pb2_grpc as pb_grpc
from waiting import wait_until


def test_killed_rank_makes_peers_raise_and_the_name_forms_again(daemon, spawn_ranks):
    report = mp.get_context("spawn").Queue()
    group = spawn_ranks(ranks.reduce_until_error, 3, 3, daemon.socket, "victim", report, timeout=120)
    words, results = kill_at_work(group, report)
    assert all(word[0] == "running" for word in words), words
    for rank in (0, 2):  # told the peer is lost (not a deadline passing), naming it
        status, (name, message, _) = results[rank]
        assert status == "ok"
        assert name == "PeerLostError", message
        assert "rank 1" in message and "'victim'" in message
    again = spawn_ranks(ranks.join_only, 3, 3, daemon.socket, "victim", {}).values()
    assert set(again.values()) == {"ok [3.0, 3.0, 3.0, 3.0]"}
    assert "session ended without Leave" in daemon.log()


def test_the_daemons_abort_of_a_group_wakes_the_ranks_sleeping_on_it(make_daemon, spawn_ranks):
    # What a CUDA rank's abort watch sleeps on (native/cuda/abort_watch.h): the daemon's abort of
    # a group whose peer died, from its process.
    daemon = make_daemon()
    report = mp.get_context("spawn").Queue()
    group = spawn_ranks(ranks.wait_for_the_abort, 2, 2, daemon.socket, report, timeout=120)
    words = dict(report.get(timeout=60) for _ in range(2))  # rank -> the abort word's reason half
    assert sorted(words) == [0, 1]
    rank_0 = group.processes[0].pid
    wait_until(lambda: _asleep_on(rank_0, words[0]), 30, f"rank 0 (pid {rank_0}) asleep on its group's abort word")
    group.kill(1)
    status, woken = group.results()[0]
    assert status == "ok" and tuple(woken) == (_native.AbortReason.PEER_LOST, 1), woken


FUTEX = {"x86_64": 202, "aarch64": 98}[platform.machine()]  # the futex() system call's number


def _asleep_on(pid: int, address: int) -> bool:
    """Whether process `pid`'s main thread sleeps in futex() on `address` (/proc/PID/syscall: the
    call it is blocked in, then its arguments)."""
    try:
        blocked = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return len(blocked) > 1 and blocked[0] == str(FUTEX) and int(blocked[1], 16) == address


def test_stalled_peer_times_out_with_who_and_where(make_daemon, spawn_ranks):
    daemon = make_daemon("--operation-timeout-seconds", "1.5")
    results = spawn_ranks(ranks.stall_peer, 2, 2, daemon.socket, timeout=60).values()
    name, message, waited = results[0]
    assert name == "DeadlineExceededError", message
    # The rank is named once, by the location prefix; no native source location.
    assert re.fullmatch(
        r"\[group 'stall', rank 0\] waited \d+\.\d s for rank 1 at barrier epoch \d+ \(its flag reads \d+\)", message
    ), message
    assert waited > 1.4  # the group's operation timeout, waited out


def test_an_abort_ends_the_call_under_way_at_once_on_every_rank(daemon, spawn_ranks):
    """Communicator.abort() on another thread while rank 0's all-reduce waits for rank 1: the call
    ends at once saying this rank aborted the group, and rank 1's next call says rank 0 left."""
    (aborted, took), (peer, _) = (
        spawn_ranks(ranks.abort_under_a_call, 2, 2, daemon.socket, timeout=60).values().values()
    )
    print(aborted, took, peer, sep="\n")
    assert (
        aborted
        == "InvalidArgumentError: [group 'abort', rank 0] this rank aborted the group (abort()): its calls under way end here"
    )
    assert took < 10.0  # not the operation timeout (20 s)
    assert peer == "PeerLostError: [group 'abort', rank 1] group closed: peer rank 0 left", peer


def test_a_running_group_outlives_its_daemon_and_the_next_one_serves_new_groups(daemon, spawn_ranks):
    context = mp.get_context("spawn")
    report, commands = context.Queue(), [context.Queue() for _ in range(2)]
    group = spawn_ranks(_restart_rank, 2, daemon.socket, report, commands, timeout=120)
    for _ in range(2):
        assert report.get(timeout=60)[0] == "connected"
    daemon.stop(signal.SIGKILL)
    daemon.start()
    # The ranks come back to the next daemon, which takes their group over.
    wait_until(
        lambda: daemon.metric("nodecomm_adopted_groups_total") == 1 and daemon.metric("nodecomm_ranks") == 2,
        30,
        daemon.log,
    )
    for queue in commands:
        queue.put("daemon restarted")
    for outcome in group.values().values():
        assert outcome["before"] == [3.0] * 8
        assert outcome["after_restart"] == [5.0] * 8, outcome  # on the old group, no daemon of its own
        assert outcome["reconnected"] == [3.0] * 8


def _restart_rank(rank, socket_path, report, commands):
    return ranks.survive_daemon_restart(rank, 2, socket_path, commands[rank], report)


def test_sigterm_drains_and_exits_zero_when_asked_to(make_daemon, spawn_ranks):
    daemon = make_daemon("--drain-on-stop", "true")
    report = mp.get_context("spawn").Queue()
    group = spawn_ranks(ranks.reduce_until_error, 2, 2, daemon.socket, "drained", report, timeout=120)
    for _ in range(2):
        assert report.get(timeout=60)[0] == "running"
    assert daemon.stop(signal.SIGTERM) == 0
    for name, message, _ in group.values().values():
        assert name == "DaemonUnavailableError", message
    log = daemon.log()
    assert "draining" in log and "stopped" in log


def test_connect_without_daemon_is_daemon_unavailable(tmp_path):

    import nodecomm

    with pytest.raises(nodecomm.DaemonUnavailableError, match="daemon unavailable"):
        nodecomm.connect("g", 0, 1, socket=str(tmp_path / "absent.sock"), timeout=2)


def test_list_groups_tracks_lifecycle(daemon, spawn_ranks):
    spawn_ranks(ranks.join_only, 2, 2, daemon.socket, "listed", {}).values()
    with grpc.insecure_channel(grpc_target(daemon.socket)) as channel:
        groups = pb_grpc.ControlStub(channel).ListGroups(pb.ListGroupsRequest(), timeout=5).groups
    assert groups == []  # both ranks left: released
    assert "group released" in daemon.log()


def test_a_lost_session_names_its_group_and_rank_on_stderr(daemon, spawn_ranks, capfd):
    """Under Python's default logging only the message is printed: it names group, rank, reason."""
    context = mp.get_context("spawn")
    report, commands = context.Queue(), context.Queue()
    group = spawn_ranks(ranks.lose_the_daemon, 1, 1, daemon.socket, report, commands, timeout=60)
    assert report.get(timeout=30) == "connected"
    daemon.stop(signal.SIGKILL)
    commands.put("daemon killed")
    assert group.values() == {0: [1.0] * 4}
    assert "[group 'lost', rank 0] session lost: the daemon connection was lost (UNAVAILABLE: " in (
        err := capfd.readouterr().err
    )
    assert "; the group runs on without the daemon (peer paths; no service path, table moves or timings)" in err


def test_every_abort_reason_maps_to_one_error():
    """native/control.h's abort_error: what a CPU collective raises, and what the Communicator asks
    for, for each reason in the abort word."""
    from nodecomm import errors

    segment = bytearray(4096)
    control = ctypes.addressof((ctypes.c_char * len(segment)).from_buffer(segment))
    reason = _native.AbortReason
    expected = {
        reason.PEER_LOST: (errors.PeerLostError, "group aborted: peer rank 3 was lost"),
        reason.DAEMON_LOST: (errors.DaemonUnavailableError, "group aborted: the daemon connection was lost"),
        reason.SHUTDOWN: (errors.DaemonUnavailableError, "group aborted: the daemon is shutting down"),
        reason.PEER_LEFT: (errors.PeerLostError, "group closed: peer rank 3 left"),
        reason.STALLED: (errors.PeerLostError, "group aborted: rank 3 timed out waiting for a peer"),
        reason.MISMATCH: (errors.GroupMismatchError, "group stopped: rank 3 found a peer with another call"),
        99: (errors.InternalError, "group aborted with unknown reason 99"),
    }
    for code, (cls, message) in expected.items():
        error = _native.error(*_native.abort_error(control, code, 3))
        assert type(error) is cls and str(error) == message, (code, error)
