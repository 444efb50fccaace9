"""One local user against another's groups: each test is an attack on a running daemon, which
must fail with a clear error while an ordinary 2-rank group beside it still connects and runs 100
all-reduces (its connect time and p50 printed beside the same without the attack). The threat
model and these figures are in docs/security.md."""

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

import nodecomm
import ranks
from conftest import Daemon, as_user, join_request, operator_identity, stub_for
from nodecomm.errors import ResourceExhaustedError
from nodecomm.service.calibration import cpu_fingerprint, fingerprint_key
from nodecomm.service.config import DaemonConfig
from nodecomm.service.server import session_messages_per_second
from nodecomm.v1 import control_pb2 as pb
from test_cli import nodecomm_cli


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
    assert f"uid {os.getuid()} may not calibrate" in refused.stderr and "operator uids ([54321])" in refused.stderr
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
            g for g in stub.ListGroups(pb.ListGroupsRequest(**operator_identity(daemon.socket)), timeout=5).groups
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
