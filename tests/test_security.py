"""One local user against another's groups and against the daemon everyone shares. Each test is an
attack as the issue that asked for these defences tried it, with real processes of other uids
(tests/conftest.py's users: A and B in the socket group, C outside it) against a real daemon: it
must be refused or bounded with a clear error, while an ordinary 2-rank group beside it still
connects and runs 100 checked all-reduces (its connect time and p50 printed beside the same
without the attack). The threat model and these figures are in docs/security.md."""

import json
import os
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

import nodecomm
import ranks
from conftest import TESTS, Daemon, User, as_user, free_port, join_request, stub_for
from nodecomm.client.daemon_process import daemon_command
from nodecomm.errors import PermissionDeniedError, ResourceExhaustedError
from nodecomm.service.calibration import cpu_fingerprint, fingerprint_key
from nodecomm.service.config import DaemonConfig
from nodecomm.service.server import session_messages_per_second
from nodecomm.socket_path import job_digest
from nodecomm.trust import checked_target, node_daemon_uids
from nodecomm.v1 import control_pb2 as pb
from test_cli import nodecomm_cli

# -- 1. a rank never talks to a daemon another user controls -------------------------------------


def quick_start_script() -> str:
    """The README's quick start train.py, as the README has it."""
    readme = (TESTS.parent / "README.md").read_text()
    return readme.split("cat > train.py <<'PY'\n", 1)[1].split("\nPY\n", 1)[0] + "\n"


def quick_start(user: User, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 train.py` in `user`'s home, as the README's quick start runs it."""
    (user.home / "train.py").write_text(quick_start_script())
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), "train.py"]
    return user.run(command, env=env, timeout=300)


def start_as(user: User, socket: str, *flags: str) -> subprocess.Popen:
    """nodecommd on `socket`, run by `user`; returns once it serves (its socket made 0666, as a
    hostile user would leave it)."""
    daemon = user.popen(
        [sys.executable, "-m", "nodecomm.service.server", "--socket", socket, "--metrics-address", "off", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not os.path.exists(socket + ".fd") or not os.path.exists(socket):
        assert daemon.poll() is None, daemon.stdout.read().decode()
        assert time.monotonic() < deadline, "the other user's daemon did not start"
        time.sleep(0.1)
    for path in (socket, socket + ".fd"):
        os.chmod(path, 0o666)
    return daemon


def what_it_saw(daemon: subprocess.Popen) -> str:
    daemon.kill()
    return daemon.communicate()[0].decode()


def test_a_daemon_another_user_placed_at_the_default_paths_gets_nothing(users):
    """1: with no XDG_RUNTIME_DIR, user B makes /tmp/nodecomm-<A>/nodecomm (0755) and serves a
    daemon there, sockets 0666, and one at A's private daemon path of a predictable job name. A's
    quick start, A's connect(daemon="private") and `nodecomm status` refuse, naming the directory,
    its owner and what to do; B's daemons never hear from A. With XDG_RUNTIME_DIR set, or once B's
    directory is gone, the same quick start runs on a private daemon of A's own."""
    a, b, _ = users
    planted = Path(f"/tmp/nodecomm-{a.uid}")
    b.run(["mkdir", "-p", "-m", "755", str(planted / "nodecomm"), str(planted / "nodecomm-jobs")])
    node = start_as(b, str(planted / "nodecomm" / "nodecomm.sock"))
    job = planted / "nodecomm-jobs" / job_digest("tp0") / "nodecomm.sock"
    b.run(["mkdir", "-m", "755", str(job.parent)])
    private = start_as(b, str(job))
    try:
        refused = quick_start(a)
        expected = f"{planted} belongs to uid {b.uid}, not to you (uid {a.uid}) or root"
        assert refused.returncode != 0 and expected in refused.stdout + refused.stderr, refused.stderr[-3000:]
        assert "export XDG_RUNTIME_DIR=$(mktemp -d)" in refused.stderr
        direct = a.python(
            "import nodecomm\n"
            "try:\n    nodecomm.connect('tp0', 0, 1, daemon='private', timeout=10)\n"
            "except nodecomm.NodecommError as error:\n    print(type(error).__name__, error)\n"
        )
        assert direct.stdout.startswith("PermissionDeniedError") and expected in direct.stdout, direct
        status = a.run([sys.executable, "-m", "nodecomm.client.cli", "status"])
        assert status.returncode == 1 and expected in status.stderr, status.stderr
        own_runtime = a.home / "run"
        own_runtime.mkdir(mode=0o700)
        os.chown(own_runtime, a.uid, a.uid)
        ran = quick_start(a, env={"XDG_RUNTIME_DIR": str(own_runtime)})
        assert ran.returncode == 0 and f"a private daemon at {own_runtime}/nodecomm-jobs/" in ran.stdout, ran.stderr
    finally:
        seen = what_it_saw(node) + what_it_saw(private)
    assert "descriptor claim" not in seen and "group formed" not in seen, seen[-3000:]
    shutil.rmtree(planted)
    ran = quick_start(a)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.count("3.0") == 2, ran.stdout  # each rank's sum (their lines may interleave)
    assert f"a private daemon at {planted}/nodecomm-jobs/" in ran.stdout, ran.stdout
    info = planted.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (a.uid, 0o700)


def test_a_runtime_directory_another_user_made_first_is_refused_with_what_to_do(users):
    """1: B's `mkdir -m700 /tmp/nodecomm-<A>` (A cannot even look inside) fails A's private job
    with a PermissionDeniedError that names the directory, its owner and what to do, not a bare
    PermissionError; nothing of A's is made or changed."""
    a, b, _ = users
    b.run(["mkdir", "-m", "700", f"/tmp/nodecomm-{a.uid}"])
    refused = a.python(
        "import nodecomm\n"
        "try:\n    nodecomm.connect('g', 0, 1, daemon='auto', timeout=10)\n"
        "except Exception as error:\n    print(type(error).__name__, error)\n"
    )
    assert refused.stdout.startswith("PermissionDeniedError"), refused
    assert f"/tmp/nodecomm-{a.uid} belongs to uid {b.uid}" in refused.stdout
    assert "Set XDG_RUNTIME_DIR" in refused.stdout
    assert Path(f"/tmp/nodecomm-{a.uid}").stat().st_uid == b.uid


def test_a_job_directory_that_is_a_link_is_refused_and_what_it_points_at_left_alone(users):
    """1: A's job directory is a symbolic link into a folder of A's (0755) holding files named
    lock, daemon.log and nodecomm.sock: connect refuses the link, and the folder's mode and files
    are as they were (no chmod, no unlink)."""
    a, _, _ = users
    runtime = a.home / "run"
    target = a.home / "precious"
    a.run(["mkdir", "-m", "700", str(runtime)])
    a.run(["mkdir", "-m", "755", str(target)])
    for name in ("lock", "daemon.log", "nodecomm.sock"):
        a.run(["sh", "-c", f"echo keep > {target / name}"])
    a.run(["mkdir", "-m", "700", str(runtime / "nodecomm-jobs")])
    a.run(["ln", "-s", str(target), str(runtime / "nodecomm-jobs" / job_digest("tp0"))])
    refused = a.python(
        "import nodecomm\n"
        "try:\n    nodecomm.connect('tp0', 0, 1, daemon='private', timeout=10)\n"
        "except Exception as error:\n    print(type(error).__name__, error)\n",
        env={"XDG_RUNTIME_DIR": str(runtime)},
    )
    assert refused.stdout.startswith("PermissionDeniedError") and "is a symbolic link" in refused.stdout, refused
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert sorted(p.name for p in target.iterdir()) == ["daemon.log", "lock", "nodecomm.sock"]
    assert all((target / name).read_text() == "keep\n" for name in ("lock", "daemon.log", "nodecomm.sock"))


def test_a_daemon_removes_no_file_it_cannot_serve_from(tmp_path):
    """1: a regular file where the socket should be is left alone: the daemon refuses to start
    (exit 2) and says why, instead of unlinking it."""
    socket_path = tmp_path / "nodecomm.sock"
    socket_path.write_text("not a socket\n")
    refused = subprocess.run(
        daemon_command(str(socket_path), "--metrics-address", "off"), capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and "is not a socket; refusing to remove it" in refused.stderr, refused.stderr
    assert socket_path.read_text() == "not a socket\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="changes uids: needs root (CI runs as root)")
def test_a_socket_served_by_another_uid_is_refused_whoever_owns_the_file(tmp_path):
    """1: a socket file root owns, in a directory root owns, listened on by a process that then
    runs as uid 41002 (SO_PEERCRED gives the listener's credentials): the client refuses it after
    connecting, before sending a byte, naming the pid and uid."""
    path = tmp_path / "nodecomm.sock"
    listener = subprocess.Popen(
        [sys.executable, "-c",
         "import os, socket, sys, time\n"
         "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); os.setresuid(41002, 41002, 41002)\n"
         "s.listen(); print('ready', flush=True)\n"
         "c, _ = s.accept(); print('received', len(c.recv(64)), flush=True)\n",
         str(path)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert listener.stdout.readline().strip() == "ready"
        with pytest.raises(PermissionDeniedError) as refused:
            checked_target(str(path), node_daemon_uids(str(path)))
        assert f"(pid {listener.pid}) runs as uid 41002" in str(refused.value)
        assert listener.stdout.readline().strip() == "received 0"  # nothing was sent
    finally:
        listener.kill()
        listener.wait()


def legitimate_group(spawn_ranks, socket: str, name: str) -> tuple[float, float]:
    """(slowest rank's connect seconds, slowest rank's p50 seconds) of an ordinary group."""
    results = spawn_ranks(ranks.legitimate_traffic, 2, 2, socket, name, timeout=120).values()
    return max(r[0] for r in results.values()), max(r[1] for r in results.values())


def report(what: str, baseline: tuple[float, float], attacked: tuple[float, float]) -> None:
    print(
        f"{what}: connect {baseline[0] * 1e3:.0f} ms without, {attacked[0] * 1e3:.0f} ms with; "
        f"p50 {baseline[1] * 1e6:.1f} us without, {attacked[1] * 1e6:.1f} us with"
    )


# A stored calibration that parses but holds what the daemon never writes, and what the log says.
BAD_CALIBRATIONS = {
    "a string boundary": (
        lambda good: good["boundaries"].update(oneshot_max_bytes="abc"),
        "boundaries.oneshot_max_bytes: 'abc' is not of type 'integer', 'null'",
    ),
    "a list of boundaries": (
        lambda good: good.update(boundaries=[1, 2]),
        "boundaries: [1, 2] is not of type 'object'",
    ),
    "a negative boundary": (
        lambda good: good["boundaries"].update(oneshot_max_bytes=-5),
        "boundaries.oneshot_max_bytes: -5 is less than the minimum of 0",
    ),
    "a boundary past any size": (
        lambda good: good["boundaries"].update(oneshot_max_bytes=1.5e300),
        "boundaries.oneshot_max_bytes: 1.5e+300 is greater than the maximum",
    ),
    "another device kind's fingerprint": (
        lambda good: good["fingerprint"].update(device_kind="cuda"),
        "its fingerprint is not this machine's (it differs in device_kind)",
    ),
}


def test_a_calibration_file_with_bad_values_is_ignored_naming_file_and_field(make_daemon, spawn_ranks, tmp_path):
    """4: every bad file leaves a serving daemon with the built-in boundaries, and says why."""
    fingerprint = cpu_fingerprint()
    key = fingerprint_key(fingerprint)
    good = {
        "key": key,
        "fingerprint": fingerprint,
        "boundaries": {"oneshot_max_bytes": 4096},
        "medians": {"oneshot": {"1024": 1e-5}, "twoshot": {"1024": 2e-5}},
        "measured_at": 0.0,
    }
    baseline_state = tmp_path / "good"
    baseline_state.mkdir()
    (baseline_state / f"calibration-{key}.json").write_text(json.dumps(good))
    daemon = make_daemon("--state-dir", str(baseline_state))
    assert "oneshot_max_bytes=4KiB (calibrated)" in nodecomm_cli("--socket", daemon.socket, "thresholds").stdout
    baseline = legitimate_group(spawn_ranks, daemon.socket, "before")
    daemon.stop()
    for case, (spoil, logged) in BAD_CALIBRATIONS.items():
        state = tmp_path / case.replace(" ", "-").replace("'", "")
        state.mkdir()
        bad = json.loads(json.dumps(good))
        spoil(bad)
        path = state / f"calibration-{key}.json"
        path.write_text(json.dumps(bad))
        daemon = make_daemon("--state-dir", str(state))
        shown = nodecomm_cli("--socket", daemon.socket, "thresholds").stdout
        assert "(calibrated)" not in shown and "(default)" in shown, (case, shown)
        assert f"ignoring the calibration in {path}: {logged}" in daemon.log(), (case, daemon.log()[-2000:])
        report(f"calibration with {case}", baseline, legitimate_group(spawn_ranks, daemon.socket, "after"))
        daemon.stop()


def test_only_operator_uids_calibrate(make_daemon, spawn_ranks, tmp_path):
    """7: a uid that may join but is not an operator cannot rewrite the node's calibration; the
    stored calibration and the boundaries in force stay as they were."""
    baseline_daemon = make_daemon("--state-dir", str(tmp_path / "baseline"))
    baseline = legitimate_group(spawn_ranks, baseline_daemon.socket, "before")
    state = tmp_path / "state"
    daemon = make_daemon("--state-dir", str(state), "--operator-uids", "54321")  # not this test's uid
    before = nodecomm_cli("--socket", daemon.socket, "thresholds").stdout
    refused = nodecomm_cli("--socket", daemon.socket, "calibrate", "--min-bytes", "1KiB", "--max-bytes", "4KiB")
    assert refused.returncode != 0
    assert (
        f"uid {os.getuid()} (root) may not calibrate" in refused.stderr and "operator uids ([54321])" in refused.stderr
    )
    attacked = legitimate_group(spawn_ranks, daemon.socket, "during")
    assert nodecomm_cli("--socket", daemon.socket, "thresholds").stdout == before
    assert not list(state.glob("calibration-*.json"))
    assert 'nodecomm_rpc_errors_total{code="PERMISSION_DENIED",method="Calibrate"} 1.0' in daemon.metrics_text()
    report("calibrate from a uid that is not an operator", baseline, attacked)


NOBODY = 65534  # uid nobody, gid nogroup on Debian


def identify_as_nobody(path: str) -> str:
    """What nodecomm.connect's first step (IDENTIFY on the descriptor socket) raises in a process
    of uid nobody."""
    return as_user(NOBODY, NOBODY, "connect", path).decode()


@pytest.mark.skipif(os.geteuid() != 0, reason="changes uids: needs root (CI runs as root)")
def test_an_unreachable_descriptor_socket_is_named_as_the_cause(spawn_ranks):
    """8: with the descriptor socket at 0600, a caller that reaches the control socket is told
    that the descriptor socket refused it, not that its Join lacked an identity; its owner's
    groups still run."""
    open_directory = Path(tempfile.mkdtemp(prefix="nodecomm-security-"))
    open_directory.chmod(0o755)
    daemon = Daemon(open_directory, ["--socket-group", "nogroup", "--allowed-gids", "nogroup"], {})
    try:
        daemon.start()
        baseline = legitimate_group(spawn_ranks, daemon.socket, "before")
        assert identify_as_nobody(daemon.socket + ".fd") == "no error"  # admitted while it may open it
        os.chmod(daemon.socket + ".fd", 0o600)
        answer = identify_as_nobody(daemon.socket + ".fd")
        assert answer == f"DaemonUnavailableError descriptor socket {daemon.socket}.fd: [Errno 13] Permission denied"
        report(
            "a caller the descriptor socket refuses", baseline, legitimate_group(spawn_ranks, daemon.socket, "after")
        )
    finally:
        daemon.stop(signal.SIGKILL)
        shutil.rmtree(open_directory, ignore_errors=True)


def test_a_killed_calibration_leaves_no_folder(make_daemon, spawn_ranks, tmp_path):
    """8: the probe's table comes back on its output; killing the daemon mid-probe leaves nothing
    in the temporary directory. An ordinary group runs beside the probe."""
    before = set(Path(tempfile.gettempdir()).glob("nodecomm-probe-*"))
    daemon = make_daemon("--state-dir", str(tmp_path / "state"))
    baseline = legitimate_group(spawn_ranks, daemon.socket, "before")
    calibrate = subprocess.Popen(
        [sys.executable, "-m", "nodecomm.client.cli", "--socket", daemon.socket, "calibrate", "--max-bytes", "64MiB"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        while "oneshot" not in calibrate.stdout.readline():  # a point: the probe runs
            assert calibrate.poll() is None
        attacked = legitimate_group(spawn_ranks, daemon.socket, "during")
        assert calibrate.poll() is None, "the probe ended before the daemon was killed"
        daemon.stop(signal.SIGKILL)
    finally:
        calibrate.kill()
        calibrate.wait()
    assert set(Path(tempfile.gettempdir()).glob("nodecomm-probe-*")) == before
    report("a calibration killed mid-probe", baseline, attacked)


def _open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_tiny_allocations_and_exchanges_cannot_exhaust_the_daemons_descriptors(daemon, spawn_ranks):
    """2: a world-1 group that allocates a byte at a time, or opens one-row exchanges, is refused
    at its per-rank (per-group) count, each allocation counted as a page; the daemon's descriptors
    stay few and an ordinary group beside it runs."""
    baseline = legitimate_group(spawn_ranks, daemon.socket, "before")
    descriptors = _open_descriptors(daemon.process.pid)
    with nodecomm.connect("hoarder", 0, 1, socket=daemon.socket, timeout=30) as hoarder:
        held = []
        with pytest.raises(ResourceExhaustedError) as refused:
            for _ in range(12000):
                held.append(hoarder.service_buffer(1))
        assert len(held) == 64 and "holds 64 allocations, this daemon's max_allocations_per_rank" in str(refused.value)
        exchanges = []
        with pytest.raises(ResourceExhaustedError) as refused:
            for _ in range(1000):
                exchanges.append(hoarder.topk_exchange(max_rows=1, topk=1))
        assert len(exchanges) == 32 and "max_topk_exchanges_per_group" in str(refused.value)
        status = json.loads(nodecomm_cli("--socket", daemon.socket, "status", "--json").stdout)
        (group,) = [g for g in status["groups"] if g["name"] == "hoarder"]
        assert group["service_bytes"] == 64 * 4096  # a byte counts as a page
        # Each allocation and slab holds a descriptor; past those, the daemon's count barely moved.
        assert _open_descriptors(daemon.process.pid) - descriptors < 64 + 32 + 32
        attacked = legitimate_group(spawn_ranks, daemon.socket, "during")
    report("a rank hoarding allocations and exchanges", baseline, attacked)


def test_many_small_groups_of_one_caller_cannot_add_up_past_its_allocation_count(make_daemon, spawn_ranks):
    """2, over groups: one uid's world-1 groups each stay within their per-rank and per-group
    counts, but together they are refused at max_allocations_per_caller (here 80), allocations and
    exchanges alike; freeing one lets one more through, and an ordinary group beside them runs."""
    daemon = make_daemon("--max-allocations-per-caller", "80")
    baseline = legitimate_group(spawn_ranks, daemon.socket, "before")
    with (
        nodecomm.connect("hoard-a", 0, 1, socket=daemon.socket, timeout=30) as first,
        nodecomm.connect("hoard-b", 0, 1, socket=daemon.socket, timeout=30) as second,
    ):
        held = [first.service_buffer(1) for _ in range(64)]
        held += [second.service_buffer(1) for _ in range(15)]
        exchange = second.topk_exchange(max_rows=1, topk=1)
        for attempt in (lambda: second.service_buffer(1), lambda: second.topk_exchange(max_rows=1, topk=1)):
            with pytest.raises(ResourceExhaustedError) as refused:
                attempt()
            assert "hold 80 allocations and top-k exchanges, this daemon's max_allocations_per_caller" in str(
                refused.value
            )
        held.pop(0).free()
        held.append(second.service_buffer(1))
        attacked = legitimate_group(spawn_ranks, daemon.socket, "during")
        exchange.close()
    report("one caller's groups hoarding allocations", baseline, attacked)


def _wait_forming(stub, name: str) -> None:
    deadline = time.monotonic() + 30
    while not any(g.name == name for g in stub.ListGroups(pb.ListGroupsRequest(), timeout=5).groups):
        assert time.monotonic() < deadline, f"group {name} never started forming"
        time.sleep(0.05)


def test_a_forming_group_cannot_be_taken_over(daemon, spawn_ranks):
    """1: while rank 1 of a keyed group is late, another process sees no world size or joined
    ranks, and its Joins as rank 1 (without the key, with a wrong key, with another capacity) are
    refused before they change anything: the real ranks form the group and reduce correctly. A
    group without a key is still closed to other uids (here: a caller with no identity)."""
    baseline = legitimate_group(spawn_ranks, daemon.socket, "before")
    channel, stub = stub_for(daemon)
    with channel:
        victims = spawn_ranks(ranks.legitimate_traffic, 2, 2, daemon.socket, "victim", 100, "the-key", 3.0)
        _wait_forming(stub, "victim")
        (shown,) = [g for g in stub.ListGroups(pb.ListGroupsRequest(), timeout=5).groups if g.name == "victim"]
        assert shown.state == "joining" and shown.world_size == 0 and not shown.joined_ranks
        (operator_view,) = [
            g for g in stub.ListGroups(pb.ListGroupsRequest(), timeout=5).groups
            if g.name == "victim"
        ]  # fmt: skip
        assert operator_view.world_size == 2 and list(operator_view.joined_ranks) == [0]
        for key, shown_whole in ((b"the-key", True), (b"guess", False)):  # a member proves it with the key
            (member_view,) = [
                g for g in stub.ListGroups(pb.ListGroupsRequest(group_key=key), timeout=5).groups if g.name == "victim"
            ]  # fmt: skip
            assert (member_view.world_size == 2) == shown_whole, key
        attempts = {
            "no key": join_request("victim", rank=1),
            "a wrong key": join_request("victim", rank=1),
            "another capacity and no key": join_request("victim", rank=1, capacity=4096),
        }
        attempts["a wrong key"].group_key = b"guess"
        for what, request in attempts.items():
            with pytest.raises(grpc.RpcError) as refused:
                stub.Join(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, what
            assert "group key is not the one the group's first Join carried" in refused.value.details(), what
        attacked = victims.values()
        # Without a key, a Join from another uid (or with no identity) is refused all the same.
        unkeyed = spawn_ranks(ranks.legitimate_traffic, 2, 2, daemon.socket, "unkeyed", 100, None, 3.0)
        _wait_forming(stub, "unkeyed")
        with pytest.raises(grpc.RpcError) as refused:
            stub.Join(join_request("unkeyed", rank=1), timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "a Join from a caller without an identity is refused" in refused.value.details()
        assert len(unkeyed.values()) == 2
    late = (attacked[1][0], max(r[1] for r in attacked.values()))  # the late rank's connect: from its own start
    report("joins posing as a forming group's late rank", baseline, late)


def test_one_caller_cannot_fill_the_daemon_with_forming_groups(daemon, spawn_ranks):
    """6: 300 half-joins from one caller: past max_forming_groups_per_caller (32) they are refused,
    and another caller's group still forms."""
    baseline = legitimate_group(spawn_ranks, daemon.socket, "before")
    channel, stub = stub_for(daemon)
    with channel:
        pending = [stub.Join.future(join_request(f"half-{i}", rank=0, timeout=30), timeout=40) for i in range(32)]
        _wait_forming(stub, "half-31")
        with pytest.raises(grpc.RpcError) as refused:
            stub.Join(join_request("half-32", rank=0, timeout=30), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "callers without an identity already started 32 groups that are still forming" in refused.value.details()
        attacked = legitimate_group(spawn_ranks, daemon.socket, "during")  # identified: its own count
        for future in pending:
            future.cancel()
    report("32 half-joined groups from one caller", baseline, attacked)


def _dropped(daemon, reason: str) -> float:
    text = daemon.metrics_text()
    return float(text.split(f'nodecomm_timings_dropped_total{{reason="{reason}"}} ')[1].split()[0])


_TIME_GET_THRESHOLDS = """
import statistics, sys, time
import grpc
from nodecomm.v1 import control_pb2 as pb, control_pb2_grpc as pb_grpc
with grpc.insecure_channel("unix:" + sys.argv[1]) as channel:
    stub = pb_grpc.ControlStub(channel)
    stub.GetThresholds(pb.GetThresholdsRequest(group="flood-many"), timeout=10)
    print("ready", flush=True)
    sys.stdin.readline()
    seconds, until = [], time.monotonic() + 1.0
    while time.monotonic() < until:
        started = time.perf_counter()
        stub.GetThresholds(pb.GetThresholdsRequest(group="flood-many"), timeout=10)
        seconds.append(time.perf_counter() - started)
    print(statistics.median(seconds), max(seconds))
"""


def _get_thresholds_seconds(daemon, meanwhile=lambda: None) -> tuple[float, float]:
    """GetThresholds' median and longest time per call over a second of calls that start right
    after meanwhile() returns, from a process of its own: the flooding clients of this one would
    otherwise slow the caller, not the daemon."""
    timer = subprocess.Popen(
        [sys.executable, "-c", _TIME_GET_THRESHOLDS, daemon.socket],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert timer.stdout.readline().strip() == "ready"
    meanwhile()
    out, _ = timer.communicate("go\n", timeout=60)
    assert timer.returncode == 0
    median, longest = map(float, out.split())
    return median, longest


def test_a_flood_of_timings_costs_the_daemon_a_bounded_share(daemon, spawn_ranks):
    """3: sessions of clients changed to flood: one sends batches of 200,000 timings (3.6 MB), past
    the daemon's 1 MiB message bound, and loses its own session; another sends batches of 1,000
    (dropped whole) and a stream of batches of 32 far past its rate (dropped past it), which the
    daemon reads at its pace (64.5 a second at the default rate) and the rest waits at the sender.
    The daemon answers everyone else as quickly meanwhile."""
    baseline = legitimate_group(spawn_ranks, daemon.socket, "before")
    timing = pb.Timing(path=pb.ONESHOT, bytes=1024, seconds=1e-5)
    huge = pb.SessionUp(timings=pb.TimingBatch(timings=[timing] * 200_000))
    large = pb.SessionUp(timings=pb.TimingBatch(timings=[timing] * 1000))
    small = pb.SessionUp(timings=pb.TimingBatch(timings=[timing] * 32))
    with (
        nodecomm.connect("flood-huge", 0, 1, socket=daemon.socket, timeout=30) as huge_flooder,
        nodecomm.connect("flood-many", 0, 1, socket=daemon.socket, timeout=30) as flooder,
    ):
        quiet = _get_thresholds_seconds(daemon)

        flood_started = [0.0]

        def flood() -> None:
            flood_started[0] = time.monotonic()
            for _ in range(5):
                huge_flooder._lease._outbox.put(huge)  # what a modified client could send
            for _ in range(100):
                flooder._lease._outbox.put(large)
            for _ in range(2000):
                flooder._lease._outbox.put(small)

        flooded = _get_thresholds_seconds(daemon, flood)
        attacked = legitimate_group(spawn_ranks, daemon.socket, "during")
        deadline = time.monotonic() + 60
        while _dropped(daemon, "batch") < 100_000 or _dropped(daemon, "rate") < 32 * 100:
            assert time.monotonic() < deadline, (_dropped(daemon, "batch"), _dropped(daemon, "rate"))
            time.sleep(0.2)
        # Read at the session's pace: never more messages than a second's burst and the rate since.
        read = 100 + _dropped(daemon, "rate") / 32
        pace = session_messages_per_second(DaemonConfig().timing_rate_per_rank)
        assert read <= pace * (time.monotonic() - flood_started[0] + 1), (read, pace)
        while huge_flooder._lease.lost_reason is None:
            assert time.monotonic() < deadline, "the 3.6 MB batches did not end their session"
            time.sleep(0.2)
        assert not flooder._lease.lost_reason
    print(
        f"GetThresholds: {quiet[0] * 1e3:.2f} ms per call quiet (longest {quiet[1] * 1e3:.1f}), "
        f"{flooded[0] * 1e3:.2f} ms during the flood's first second (longest {flooded[1] * 1e3:.1f})"
    )
    report("sessions flooding timings", baseline, attacked)


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


def test_silent_connections_neither_exhaust_descriptors_nor_threads(daemon, spawn_ranks):
    """5: thousands of connections to both sockets that never send a byte: the descriptor socket
    serves them from one thread and closes each after 2 s, gRPC closes those that do not finish
    their handshake in 3 s; an ordinary group connects and runs meanwhile, and the daemon's
    descriptors and threads come back to where they were."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 16384)), hard))
    baseline = legitimate_group(spawn_ranks, daemon.socket, "before")
    pid = daemon.process.pid
    descriptors, threads = _open_descriptors(pid), _threads(pid)
    silent = []
    try:
        for path in (daemon.socket, daemon.socket + ".fd"):
            for _ in range(2000):
                connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                connection.connect(path)
                silent.append(connection)
        most_threads = _threads(pid)
        attacked = legitimate_group(spawn_ranks, daemon.socket, "during")
        deadline = time.monotonic() + 30
        while _open_descriptors(pid) > descriptors + 16:
            assert time.monotonic() < deadline, f"{_open_descriptors(pid)} descriptors, {descriptors} before"
            time.sleep(0.2)
    finally:
        for connection in silent:
            connection.close()
    assert most_threads <= threads + 8, (threads, most_threads)
    print(f"daemon threads {threads} before, {most_threads} with 4000 silent connections")
    report("4000 silent connections", baseline, attacked)
