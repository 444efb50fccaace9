"""A job's own daemon where no node daemon answers: started by the first rank to claim it, exact
collectives through it, one per job, gone with the job's last rank (SIGKILL included)."""

import multiprocessing as mp
import os
import shutil
import signal
import socket as unix_sockets
import tempfile
import time
from pathlib import Path

import pytest

import distributed_ranks
import nodecomm
from conftest import free_port
from nodecomm.service.calibration.stored import CalibrationStore
from nodecomm.tools.convergence_bench import every_size_to
from test_distributed import reports, torchrun
from waiting import wait_until


def private_daemons(socket: str) -> list[int]:
    """Pids of private daemons serving `socket`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--private" in command and socket.encode() in command:
            found.append(int(entry.name))
    return found


def both_ranks_back(socket: str) -> bool:
    """Whether the daemon serving `socket` holds an active group whose ranks 0 and 1 are live."""
    import grpc

    from nodecomm.socket_path import grpc_target
    from nodecomm.v1 import control_pb2 as pb
    from nodecomm.v1 import control_pb2_grpc as pb_grpc

    with grpc.insecure_channel(grpc_target(socket)) as channel:
        try:
            groups = pb_grpc.ControlStub(channel).ListGroups(pb.ListGroupsRequest(), timeout=5).groups
        except grpc.RpcError:
            return False  # not serving yet
    return any(g.state == "active" and sorted(g.live_ranks) == [0, 1] for g in groups)


def wait_gone(socket: str, seconds: float) -> None:
    """Until no private daemon serves `socket` and its directory is gone."""
    directory = Path(socket).parent

    def left() -> str:
        files = sorted(p.name for p in directory.glob("*")) if directory.exists() else "removed"
        return (
            f"the private daemon of {socket} gone with its directory (daemons {private_daemons(socket)}, files {files})"
        )

    wait_until(lambda: not private_daemons(socket) and not directory.exists(), seconds, left)


@pytest.fixture
def runtime_directory():
    """A runtime directory of the test's own, short enough for socket paths (pytest's are not)."""
    directory = tempfile.mkdtemp(prefix="nc-run-", dir="/tmp")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def no_node_daemon(runtime_directory):
    """The environment of a machine with no node daemon: nothing at NODECOMM_SOCKET, and the
    private daemons' directories under the test's own runtime directory."""
    return {
        "NODECOMM_SOCKET": os.path.join(runtime_directory, "no-daemon-here.sock"),
        "XDG_RUNTIME_DIR": runtime_directory,
    }


def test_torchrun_jobs_without_a_node_daemon_get_one_private_daemon_each(no_node_daemon):
    environment = no_node_daemon
    jobs = {n: torchrun(n, environment["NODECOMM_SOCKET"], environment=environment) for n in (2, 4)}
    sockets = {}
    for ranks, job in jobs.items():
        daemons: dict[int, str] = {}
        printed: list[str] = []
        found = reports(job, printed, daemons=daemons)
        assert found == {r: [] for r in range(ranks)}, found
        # NODECOMM_SOCKET named a daemon that is not there: the job says so, once in each process
        # that decides (a group's rank 0).
        warning = f"NODECOMM_SOCKET {environment['NODECOMM_SOCKET']} names a node daemon, but none answers there"
        assert 1 <= printed[0].count(warning) <= ranks, printed[0][-3000:]
        assert len(set(daemons.values())) == 1, daemons  # every rank of the job, one daemon
        kind, sockets[ranks] = daemons[0].split(" ", 1)
        assert kind == "private" and sockets[ranks].startswith(environment["XDG_RUNTIME_DIR"])
    assert sockets[2] != sockets[4]
    for socket in sockets.values():
        wait_gone(socket, 10)


def test_killing_every_rank_leaves_no_daemon_and_no_socket(no_node_daemon, spawn_ranks):
    report = mp.get_context("spawn").Queue()
    group = spawn_ranks(distributed_ranks.hold_the_job, 3, 3, free_port(), no_node_daemon, report, timeout=120)
    seen = [report.get(timeout=60) for _ in range(3)]
    assert {(kind, tuple(total)) for _, kind, _, total in seen} == {("private", (3.0, 3.0, 3.0, 3.0))}
    socket = seen[0][2]
    assert len(private_daemons(socket)) == 1 and os.path.exists(socket)
    for rank in range(3):
        group.kill(rank, signal.SIGKILL)
    wait_gone(socket, 8)


def test_auto_uses_a_node_daemon_that_answers(daemon, runtime_directory):
    environment = {"XDG_RUNTIME_DIR": runtime_directory}
    daemons: dict[int, str] = {}
    assert reports(torchrun(2, daemon.socket, environment=environment), daemons=daemons) == {0: [], 1: []}
    assert set(daemons.values()) == {f"node {daemon.socket}"}
    assert '"group": "torch.' in daemon.log()
    assert not os.path.exists(os.path.join(runtime_directory, "nodecomm-jobs"))  # no private daemon started


def connect_privately(rank: int, world_size: int, runtime: str) -> str:
    os.environ["XDG_RUNTIME_DIR"] = runtime
    import torch

    with nodecomm.connect("alone", rank, world_size, daemon="private", timeout=30) as comm:
        total = comm.all_reduce(torch.full((4,), float(rank + 1)))
        return f"{comm.daemon.kind} {total.tolist()}"


def test_connect_takes_a_private_daemon_when_asked_and_refuses_an_unknown_mode(runtime_directory, spawn_ranks):
    results = spawn_ranks(connect_privately, 2, 2, runtime_directory, timeout=120).values()
    assert set(results.values()) == {"private [3.0, 3.0, 3.0, 3.0]"}
    with pytest.raises(nodecomm.InvalidArgumentError, match="daemon 'anywhere': expected one of auto, node, private"):
        nodecomm.connect("g", 0, 1, daemon="anywhere")
    # The node daemon, where none answers: what to do about it.
    nowhere = os.path.join(runtime_directory, "no-daemon.sock")
    with pytest.raises(nodecomm.DaemonUnavailableError) as raised:
        nodecomm.connect("g", 0, 1, socket=nowhere, daemon="node", timeout=5)
    assert str(raised.value) == (
        f"[group 'g', rank 0] daemon unavailable: nothing serves at {nowhere} (No such file or directory): start "
        "nodecommd there, set NODECOMM_SOCKET to the socket of one that runs, or pass daemon='auto' "
        "(NODECOMM_DAEMON=auto) for a daemon private to the job where no node daemon answers"
    )
    assert isinstance(raised.value, nodecomm.errors.NoDaemonError)
    # A socket nothing listens on (its daemon gone without removing it): the same advice.
    refusing = os.path.join(runtime_directory, "gone-daemon.sock")
    with unix_sockets.socket(unix_sockets.AF_UNIX) as gone:
        gone.bind(refusing)
        with pytest.raises(nodecomm.DaemonUnavailableError) as raised:
            nodecomm.connect("g", 0, 1, socket=refusing, daemon="node", timeout=5)
    assert str(raised.value).startswith(
        f"[group 'g', rank 0] daemon unavailable: nothing serves at {refusing} (Connection refused): start nodecommd "
    ), raised.value


def test_a_private_daemon_whose_directory_was_removed_still_leaves_with_its_job(no_node_daemon, spawn_ranks):
    """The job's directory removed under a running job (a runtime directory cleaned up): once the
    job's ranks are gone the daemon stops all the same; it had waited forever for the lock file."""
    report = mp.get_context("spawn").Queue()
    group = spawn_ranks(distributed_ranks.hold_the_job, 2, 2, free_port(), no_node_daemon, report, timeout=120)
    seen = [report.get(timeout=60) for _ in range(2)]
    socket = seen[0][2]
    assert len(private_daemons(socket)) == 1
    shutil.rmtree(Path(socket).parent)
    for rank in range(2):
        group.kill(rank, signal.SIGKILL)
    wait_gone(socket, 8)


def test_a_private_daemon_that_cannot_start_says_why_and_leaves_nothing(runtime_directory, monkeypatch):
    """A setting the daemon refuses (here NODECOMM_LOG_LEVEL=FOO, which the job's daemon takes from
    the environment): connect raises DaemonUnavailableError with the daemon's own words, and the
    job's directory (its log, its lock file) is gone."""
    import pytest

    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime_directory)
    monkeypatch.setenv("NODECOMM_LOG_LEVEL", "FOO")
    with pytest.raises(nodecomm.DaemonUnavailableError, match="log_level 'FOO': expected DEBUG"):
        nodecomm.connect("fails", 0, 1, daemon="private", timeout=30)
    assert os.listdir(os.path.join(runtime_directory, "nodecomm-jobs")) == []


def learn_privately(rank: int, world_size: int, runtime: str, nbytes: int, synthetic: list, calls: int) -> dict:
    """Through the job's private daemon: report `synthetic` timings (what sampled all-reduces
    send), then all-reduce `nbytes` `calls` times, 5 ms apart (a busy daemon may take a while to
    move the table: the calls give it time); the table's path for nbytes and its origin, first
    and last."""
    os.environ["XDG_RUNTIME_DIR"] = runtime
    import torch

    from nodecomm.thresholds import Path as ThresholdPath

    with nodecomm.connect("learns", rank, world_size, daemon="private", timeout=30) as comm:
        first = comm.thresholds()
        for path, size, seconds in synthetic:
            comm._session.report(ThresholdPath(path).to_proto(), size, seconds)
        comm._session.flush()
        x, out = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        for _ in range(calls):
            comm.all_reduce(x, out=out)
            time.sleep(0.005)  # not a wait: calls a few milliseconds apart, as a job's steps
        # A rank that left straight after a switch-point call could abort its peer's agreement there.
        comm.barrier()
        last = comm.thresholds()
        return {
            "socket": comm.daemon.socket,
            "first": (first.path_for(nbytes).value, first.origin),
            "last": (last.path_for(nbytes).value, last.origin),
        }


def test_the_next_private_daemon_starts_from_what_the_last_one_learned(
    runtime_directory, spawn_ranks, monkeypatch, tmp_path
):
    """Job 1's private daemon starts from the node's stored table (every size to oneshot), learns
    from its ranks' timings that twoshot is ten times faster at 1 MiB, and keeps that in the
    user's cache, made 0700; the node's state stays as it was. Job 2's private daemon starts from
    the cache, the newer: its first table already sends 1 MiB to twoshot and says so. The timings
    are the ranks' reports, synthetic (as in test_live_thresholds.py): on a busy 2-core machine
    the measured paths are within the margin of each other at 1 MiB as often as not."""
    state, cache, mib = tmp_path / "state", tmp_path / "cache", 1 << 20
    stored = CalibrationStore(str(state)).save(every_size_to("oneshot", "cpu"))
    before = stored.read_bytes()
    for name, value in (
        ("STATE_DIR", str(state)),
        ("EXPLORE_PERIOD", "0"),
        ("TIMING_SAMPLE_PERIOD", "100000"),
        ("TABLE_SWITCH_PERIOD", "16"),
        ("LIVE_MIN_SAMPLES", "4"),
    ):
        monkeypatch.setenv("NODECOMM_" + name, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    synthetic = [("oneshot", mib, 1e-3)] * 6 + [("twoshot", mib, 1e-4)] * 6
    first = spawn_ranks(learn_privately, 2, 2, runtime_directory, mib, synthetic, 400, timeout=300).values()
    assert first[0]["first"] == ("oneshot", f"{stored}, measured " + first[0]["first"][1].split(", measured ")[1])
    assert first[0]["last"][0] == "twoshot", first
    wait_gone(first[0]["socket"], 10)
    (kept,) = (cache / "nodecomm").glob("calibration-*.json")
    assert (cache / "nodecomm").stat().st_mode & 0o777 == 0o700 and stored.read_bytes() == before
    second = spawn_ranks(learn_privately, 2, 2, runtime_directory, mib, [], 10, timeout=120).values()
    assert second[0]["first"][0] == "twoshot" and second[0]["first"][1].startswith(f"{kept}, measured "), second


def test_a_private_daemon_that_dies_is_replaced_by_its_jobs_ranks(runtime_directory, spawn_ranks):
    """SIGKILL of a job's own daemon: its ranks call on, one of them starts the next (the job
    directory's lock decides which), and it adopts the group (the key is in the job's directory,
    which the killed daemon left); once the ranks are gone it leaves as the first would have,
    taking the directory, key included."""
    import restart_ranks

    context = mp.get_context("spawn")
    report, commands = context.Queue(), [context.Queue() for _ in range(2)]
    group = spawn_ranks(restart_ranks.ride_on_private, 2, 2, runtime_directory, report, commands, timeout=180)
    seen = sorted(report.get(timeout=60) for _ in range(2))
    socket = seen[0][2]
    (first,) = private_daemons(socket)
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: private_daemons(socket) not in ([], [first]), 30, "a rank started the next private daemon")
    (second,) = private_daemons(socket)
    wait_until(lambda: both_ranks_back(socket), 60, "the ranks handed their group to the next private daemon")
    for queue in commands:
        queue.put("stop")
    for outcome in group.values().values():
        assert outcome["failed"] == 0 and outcome["wrong"] == 0 and outcome["steps"] > 10, outcome
        assert outcome["adoptions"] == 1, outcome
    assert second != first
    wait_gone(socket, 15)


def test_a_job_removes_what_a_killed_private_daemon_left_once_its_job_is_gone(runtime_directory, monkeypatch):
    """A private daemon killed with SIGKILL, with no rank of its job left to start the next,
    leaves its directory (sockets, lock file, log, adoption key). The next job to start a private
    daemon removes it, once nothing was written there for a minute (before that, the job's ranks
    may still come back to it); a directory whose daemon serves stays."""
    from nodecomm.client import daemon_choice
    from nodecomm.socket_path import private_socket_path

    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime_directory)
    killed_socket = private_socket_path("killed-job")
    _, lease = daemon_choice.attach_private(killed_socket, 30, {})
    (pid,) = private_daemons(killed_socket)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not private_daemons(killed_socket), 10, "the killed daemon gone")
    lease.release()
    killed = Path(killed_socket).parent
    assert {"lock", "daemon.log", "adoption.key", "nodecomm.sock"} <= {p.name for p in killed.iterdir()}
    live_socket = private_socket_path("live-job")
    _, live_lease = daemon_choice.attach_private(live_socket, 30, {})
    assert killed.exists()  # written to a moment ago: its job's ranks may yet start the next daemon there
    an_hour_ago = time.time() - 3600
    for path in [*killed.iterdir(), killed, *Path(live_socket).parent.iterdir(), Path(live_socket).parent]:
        os.utime(path, (an_hour_ago, an_hour_ago), follow_symlinks=False)
    # The job's own ranks sweep everything but their own directory (they restart their daemon there).
    assert daemon_choice.sweep_abandoned_jobs(str(killed.parent), {}, keep=str(killed)) == []
    _, third_lease = daemon_choice.attach_private(private_socket_path("third-job"), 30, {})
    assert not killed.exists() and Path(live_socket).exists()
    for held in (live_lease, third_lease):
        held.release()
    wait_gone(live_socket, 15)
