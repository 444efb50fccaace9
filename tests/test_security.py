"""One local user against another's groups and against the daemon everyone shares. Each test is an
attack as the issue that asked for these defences tried it, with real processes of other uids
(tests/conftest.py's users: A and B in the socket group, C outside it) against a real daemon: it
must be refused or bounded with a clear error, while an ordinary 2-rank group beside it still
connects and runs 100 checked all-reduces (its connect time and p50 printed beside the same
without the attack). The threat model and these figures are in docs/security.md."""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import nodecomm
import ranks
from conftest import SOCKET_GID, TESTS, Daemon, User, as_user, free_port, results, self_signed
from nodecomm.client.daemon_process import daemon_command
from nodecomm.errors import PermissionDeniedError, ResourceExhaustedError
from nodecomm.service.calibration.fingerprint import cpu_fingerprint, fingerprint_key
from nodecomm.service.config import DaemonConfig
from nodecomm.service.server import session_messages_per_second
from nodecomm.socket_path import descriptor_socket_path, job_digest
from nodecomm.trust import checked_target, node_daemon_uids
from nodecomm.v1 import control_pb2 as pb
from test_cli import nodecomm_cli, processes_naming
from waiting import wait_until

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
        [sys.executable, "-m", "nodecomm.service", "--socket", socket, "--metrics-address", "off", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip

    def serving() -> bool:
        assert daemon.poll() is None, daemon.stdout.read().decode()
        return os.path.exists(descriptor_socket_path(socket)) and os.path.exists(socket)

    wait_until(serving, 60, "the other user's daemon serving")
    for path in (socket, descriptor_socket_path(socket)):
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
        status = a.run([sys.executable, "-m", "nodecomm.tools.cli", "status"])
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
    PermissionError; nothing of A's is made or changed. So does a nodecomm-jobs/ that B made first
    in a runtime directory anyone may write to (sticky, as /tmp is), where B could otherwise swap
    in job directories of its own."""
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
    # A runtime directory others may write to (sticky, as /tmp is): B made nodecomm-jobs there first.
    shared = Path(tempfile.mkdtemp(prefix="nodecomm-shared-"))
    shared.chmod(0o1777)
    try:
        b.run(["mkdir", "-m", "755", str(shared / "nodecomm-jobs")])
        refused = a.python(
            "import nodecomm\n"
            "try:\n    nodecomm.connect('g', 0, 1, daemon='private', timeout=10)\n"
            "except Exception as error:\n    print(type(error).__name__, error)\n",
            env={"XDG_RUNTIME_DIR": str(shared)},
        )
        assert refused.stdout.startswith("PermissionDeniedError"), refused
        assert f"{shared}/nodecomm-jobs belongs to uid {b.uid}, not to you (uid {a.uid})" in refused.stdout
    finally:
        shutil.rmtree(shared)


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


# -- the node daemon the users share ----------------------------------------------------------------


class NodeDaemon(Daemon):
    """A root daemon whose socket directory it makes itself (run/, 0750 in the socket group), in a
    directory every user can traverse."""

    @property
    def socket(self) -> str:
        return str(self.directory / "run" / "nodecomm.sock")


@pytest.fixture
def node_daemon(users):
    """node_daemon(*flags): a NodeDaemon with the socket group SOCKET_GID (A and B are members)."""
    made: list[NodeDaemon] = []

    def make(*flags: str) -> NodeDaemon:
        directory = Path(tempfile.mkdtemp(prefix="nodecomm-node-"))
        directory.chmod(0o755)
        daemon = NodeDaemon(directory, ["--socket-group", str(SOCKET_GID), *flags])
        made.append(daemon)
        return daemon.start()

    try:
        yield make
    finally:
        for daemon in made:
            daemon.stop(signal.SIGKILL)
            shutil.rmtree(daemon.directory, ignore_errors=True)


def ordinary_group(
    user: User, socket: str, name: str, key: str | None = None, env: dict[str, str] | None = None
) -> tuple[float, float]:
    """(slowest rank's connect seconds, slowest rank's p50 seconds) of `user`'s 2-rank group."""
    results = user.ranks("legitimate_traffic", 2, socket, name, 100, key, env=env)
    return max(r[0] for r in results), max(r[1] for r in results)


def raw_joins(user: User, target: str, names: list[str], key: str = "", timeout: float = 30.0) -> list[str]:
    """Each Join's outcome, in order, for one-rank groups `names` that `user` joins with raw gRPC
    (no identity, no claim): "ok", or "CODE details"."""
    script = """
import json, os, sys, grpc
from nodecomm.v1 import control_pb2 as pb, control_pb2_grpc as pb_grpc
target, names, key = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3].encode()
outcomes = []
with grpc.insecure_channel(target) as channel:
    stub = pb_grpc.ControlStub(channel)
    for name in names:
        request = pb.JoinRequest(group=name, rank=0, world_size=1, device="cpu", pid=os.getpid(),
            geometry=pb.Geometry(capacity_bytes=4096, dtypes=[pb.FLOAT32]), join_timeout_seconds=5, group_key=key)
        try:
            stub.Join(request, timeout=30)
            outcomes.append("ok")
        except grpc.RpcError as error:
            outcomes.append(f"{error.code().name} {error.details()}")
print(json.dumps(outcomes))
"""
    finished = user.python(script, target, json.dumps(names), key, timeout=timeout + 60)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return json.loads(finished.stdout.strip().splitlines()[-1])


def status_as(user: User | None, socket: str) -> list[dict]:
    """`nodecomm status --json`'s groups as `user` sees them (None: root, an operator)."""
    command = [sys.executable, "-m", "nodecomm.tools.cli", "--socket", socket, "status", "--json"]
    finished = user.run(command) if user is not None else subprocess.run(command, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    return json.loads(finished.stdout)["groups"]


# -- 2. TCP keeps the uid separation ----------------------------------------------------------------


def test_over_tcp_a_join_needs_a_group_key_and_counts_against_its_uid(users, node_daemon):
    """2: with tcp_address set, user B's Join over TCP as rank 1 of user A's forming group is
    refused without a key, and with A's key lands in B's own namespace (the daemon reads B's uid
    off /proc/net/tcp) and never meets A's ranks; A's group forms over TCP and reduces exactly.
    User C, outside the socket group, reaches the TCP port, and its groups count against its own
    share (max_groups_per_caller, here 4)."""
    port = free_port()
    daemon = node_daemon("--tcp-address", f"127.0.0.1:{port}", "--max-groups-per-caller", "4")
    a, b, c = users
    target = f"ipv4:127.0.0.1:{port}"
    baseline = ordinary_group(a, daemon.socket, "before")
    victims = a.start_ranks("legitimate_traffic", 2, target, "victim", 100, "k", 4.0)
    wait_until(  # rank 0 has joined; rank 1 is 4 s late
        lambda: any(g["name"] == "victim" and 0 in g.get("joined_ranks", []) for g in status_as(None, daemon.socket)),
        60,
        "A's rank 0 joined to its group",
    )
    unkeyed, keyed = raw_joins(b, target, ["victim"]) + raw_joins(b, target, ["victim"], key="k")
    assert unkeyed.startswith("PERMISSION_DENIED") and "a Join over TCP must carry a group key" in unkeyed, unkeyed
    assert keyed == "ok"  # B's own one-rank "victim", in B's namespace: A's rank 0 never saw it
    results(victims)  # A's ranks formed "victim" and reduced exactly
    owners = {(g["name"], g["owner"]) for g in status_as(None, daemon.socket)}
    assert ("victim", f"uid {b.uid}") in owners, owners
    outcomes = raw_joins(c, target, [f"c{i}" for i in range(6)], key="c")
    assert outcomes[:4] == ["ok"] * 4, outcomes
    assert all(
        o.startswith("RESOURCE_EXHAUSTED") and f"uid {c.uid} holds 4 groups formed or forming" in o
        for o in outcomes[4:]
    ), outcomes
    during = ordinary_group(a, daemon.socket, "during")
    report("Joins over TCP from other uids", baseline, during)


# -- 3. no user can lock the others out ---------------------------------------------------------------


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS:"))


def _open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def resources(pid: int) -> dict[str, int]:
    return {"fds": _open_descriptors(pid), "threads": _threads(pid), "rss": _rss_bytes(pid)}


_HOLD_CONNECTIONS = """
import json, sys, time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
target, count = sys.argv[1], int(sys.argv[2])
channels, outcomes = [], {}
for _ in range(count):
    # A subchannel of its own: one connection per channel, each finishing the HTTP/2 handshake,
    # making a call, then idle, answering the daemon's pings.
    channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        outcomes["SERVING"] = outcomes.get("SERVING", 0) + 1
    except grpc.RpcError as error:
        outcomes[f"{error.code().name} {error.details()}"] = outcomes.get(f"{error.code().name} {error.details()}", 0) + 1
    channels.append(channel)
print(json.dumps(outcomes), flush=True)
sys.stdin.readline()  # hold them until told
"""


def test_idle_connections_of_one_user_are_capped_and_closed(users, node_daemon):
    """3: user B opens 300 connections to the control socket that finish the HTTP/2 handshake,
    make a call, then stay idle, answering pings: past max_connections_per_caller (here 32) a
    call is answered RESOURCE_EXHAUSTED naming B's uid and the limit (while 64 refused connections
    linger; past them a connection is closed at once), and the 32 are closed by the daemon after
    connection_idle_seconds (here 3) although B keeps them open. User A connects and reduces
    meanwhile; the daemon's descriptors come back to within 8, its threads within 2 and its RSS
    within 32 MiB of where they were."""
    daemon = node_daemon("--max-connections-per-caller", "32", "--connection-idle-seconds", "3")
    a, b, _ = users
    pid = daemon.process.pid
    baseline = ordinary_group(a, daemon.socket, "before")
    wait_until(
        lambda: "nodecomm_connections 0.0" in daemon.metrics_text(), 30, "the baseline group's connections closed"
    )
    before = resources(pid)
    holder = b.start(_HOLD_CONNECTIONS, f"unix:{daemon.socket}", "300")
    try:
        outcomes = json.loads(holder.stdout.readline())
        during = resources(pid)
        attacked = ordinary_group(a, daemon.socket, "during")
        # Past the share: told why while at most 64 refused connections linger, closed at once past them.
        refused = f"RESOURCE_EXHAUSTED uid {b.uid} holds 32 connections to this daemon, its max_connections_per_caller"
        told = sum(n for outcome, n in outcomes.items() if outcome.startswith(refused))
        assert outcomes.get("SERVING") == 32 and told >= 64, outcomes
        assert all(o == "SERVING" or o.startswith((refused, "UNAVAILABLE")) for o in outcomes), outcomes
        wait_until(lambda: "nodecomm_connections 0.0" in daemon.metrics_text(), 30, "B's idle connections closed")
        after = resources(pid)
        assert holder.poll() is None  # B still holds them: the daemon closed its ends
    finally:
        holder.kill()
        holder.wait()
    line = 'nodecomm_connections_refused_total{reason="per_caller"} '
    refusals = float(daemon.metrics_text().split(line)[1].split()[0])
    assert refusals >= 268, refusals  # a client closed at once may try again before it gives up
    assert after["fds"] <= before["fds"] + 8 and after["threads"] <= before["threads"] + 2, (before, after)
    assert after["rss"] <= before["rss"] + (32 << 20), (before, during, after)
    print(f"daemon before / with 300 of B's connections / after: {before} / {during} / {after}")
    report("300 idle connections of one user", baseline, attacked)


_HOARD = """
import sys, nodecomm
from nodecomm.errors import ResourceExhaustedError
held = []
with nodecomm.connect("hoard", 0, 1, socket=sys.argv[1], timeout=30, capacity_bytes=4096) as comm:
    try:
        while True:
            held.append(comm.service_buffer(8 << 20))
    except ResourceExhaustedError as error:
        print(len(held), error, flush=True)
    sys.stdin.readline()  # hold them until told
"""


def test_one_user_cannot_take_every_group_slot_or_every_byte(users, node_daemon):
    """3: user B's service allocations stop at max_reserved_bytes_per_caller (64 MiB of the
        daemon's 256 MiB) with RESOURCE_EXHAUSTED naming B's uid and the limit, and while B holds them
    X groups, joined raw (no identity: the daemon
        reads B's uid as B connects), stop at max_groups_per_caller (here 8), and A's group forms
        beside them."""
    daemon = node_daemon(
        "--max-groups-per-caller", "8", "--max-reserved-bytes", "256MiB", "--max-reserved-bytes-per-caller", "64MiB",
        "--session-grace-seconds", "120",
    )  # fmt: skip
    a, b, _ = users
    baseline = ordinary_group(a, daemon.socket, "before")
    hoarder = b.start(_HOARD, daemon.socket)
    try:
        held, _, error = hoarder.stdout.readline().partition(" ")
        assert held == "7", (held, error, hoarder.stderr.read() if hoarder.poll() is not None else "")
        assert (
            f"the groups of uid {b.uid} already reserve" in error and "max_reserved_bytes_per_caller 67108864" in error
        )
        allocated = a.python(
            "import sys, torch, nodecomm\n"
            "with nodecomm.connect('room', 0, 1, socket=sys.argv[1], timeout=30, capacity_bytes=4096) as comm:\n"
            "    print(comm.service_buffer(32 << 20).tensor(16, torch.float32).numel())\n",
            daemon.socket,
        )
        assert allocated.stdout.strip() == "16", allocated.stderr[-3000:]
    finally:
        hoarder.kill()
        hoarder.wait()
    outcomes = raw_joins(b, f"unix:{daemon.socket}", [f"b{i}" for i in range(12)])
    assert outcomes[:8] == ["ok"] * 8, outcomes
    refused = f"uid {b.uid} holds 8 groups formed or forming, this daemon's max_groups_per_caller"
    assert all(o.startswith("RESOURCE_EXHAUSTED") and refused in o for o in outcomes[8:]), outcomes
    attacked = ordinary_group(a, daemon.socket, "during")
    report("one user's groups and allocations at its shares", baseline, attacked)


_FLOOD_SESSIONS = """
import sys, time, nodecomm
from nodecomm.v1 import control_pb2 as pb
socket, groups, timings, batches = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
comms = [nodecomm.connect(f"flood-{i}", 0, 1, socket=socket, timeout=60, capacity_bytes=4096) for i in range(groups)]
timing = pb.Timing(path=pb.ONESHOT, bytes=1024, seconds=1e-5)
batch = pb.SessionUp(timings=pb.TimingBatch(timings=[timing] * timings))
print("connected", flush=True)
sys.stdin.readline()
for _ in range(batches):  # what a modified client could send: every batch of every session, at once
    for comm in comms:
        comm._session._outbox.put(batch)
print("sent", flush=True)
for _ in sys.stdin:  # each line asks how many sessions the daemon ended
    print(sum(comm._session.lost_reason is not None for comm in comms), flush=True)
"""


def _lost_sessions(flooder: subprocess.Popen) -> int:
    """How many of the _FLOOD_SESSIONS process's sessions have ended."""
    flooder.stdin.write("\n")
    flooder.stdin.flush()
    return int(flooder.stdout.readline())


def _sampled(daemon, uid: int) -> float:
    prefix = f'nodecomm_sampled_operations_total{{op="all_reduce",path="oneshot",uid="{uid}"}} '
    return next(
        (float(line.split()[-1]) for line in daemon.metrics_text().splitlines() if line.startswith(prefix)), 0.0
    )


def test_many_sessions_of_one_user_share_one_pace(users, node_daemon):
    """3: user B's 40 one-rank groups each send 400 batches of 32 timings at once. The daemon reads
    all of B's sessions at one shared pace (timing_rate_per_caller, here 3200 timings a second:
    202 messages a second), so the timings it takes from B stay within that pace, while another
    process's GetThresholds stays as quick as before and user A's group runs."""
    daemon = node_daemon("--timing-rate-per-caller", "3200")
    a, b, _ = users
    baseline = ordinary_group(a, daemon.socket, "before")
    flooder = b.start(_FLOOD_SESSIONS, daemon.socket, "40", "32", "400")
    try:
        assert flooder.stdout.readline().strip() == "connected", flooder.stderr.read()
        quiet = _get_thresholds_seconds(daemon, group="")
        started = [0.0]

        def flood() -> None:
            started[0] = time.monotonic()
            flooder.stdin.write("go\n")
            flooder.stdin.flush()

        flooded = _get_thresholds_seconds(daemon, flood, group="")
        assert flooder.stdout.readline().strip() == "sent"
        attacked = ordinary_group(a, daemon.socket, "during")
        taken, elapsed = _sampled(daemon, b.uid), time.monotonic() - started[0]
    finally:
        flooder.kill()
        flooder.wait()
    pace = session_messages_per_second(3200)
    # A Pace lets a second's worth through at once, both ends of that second included: pace + 1
    # messages, then pace a second (a run took 859 messages of 32 in 3.25 s at 202 a second).
    assert 0 < taken <= 32 * (pace * (elapsed + 1) + 1), (taken, pace, elapsed)
    print(
        f"B's 40 sessions: {taken:.0f} timings taken in {elapsed:.1f} s (pace {32 * pace:.0f}/s); GetThresholds "
        f"{quiet[0] * 1e3:.2f} ms quiet, {flooded[0] * 1e3:.2f} ms during the flood"
    )
    report("40 sessions of one user flooding timings", baseline, attacked)


_HOLD_A_GROUP = """
import sys, nodecomm
with nodecomm.connect("held", 0, 1, socket=sys.argv[1]):
    print("in", flush=True)
    sys.stdin.readline()
"""


def test_a_name_is_its_owners_whoever_else_uses_it(users, node_daemon):
    """3: user B squats the names user A's job uses (a forming group "tp0" of 2 ranks, "bench",
    which the calibration probe once used) and sees none of A's: A's "tp0" forms and reduces,
    `nodecomm calibrate` runs (its probe's group name is new and unguessable each time), B's
    ListGroups shows B's groups only, and B asking for "tp0"'s table gets B's own answer, never
    A's; root, an operator, sees both with their owners."""
    daemon = node_daemon("--session-grace-seconds", "120")
    a, b, _ = users
    baseline = ordinary_group(a, daemon.socket, "before")
    squat = b.start_ranks("legitimate_traffic", 2, daemon.socket, "tp0", 1, None, 60.0)
    try:
        assert raw_joins(b, f"unix:{daemon.socket}", ["bench"]) == ["ok"]
        wait_until(
            lambda: any(g["name"] == "tp0" for g in status_as(b, daemon.socket)), 60, "B's squatting group forming"
        )
        attacked = ordinary_group(a, daemon.socket, "tp0")
        holder = a.start(_HOLD_A_GROUP, daemon.socket)
        assert holder.stdout.readline().strip() == "in"
        seen_by_b = {g["name"] for g in status_as(b, daemon.socket)}
        assert seen_by_b == {"tp0", "bench"}, seen_by_b
        seen_by_root = {(g["name"], g["owner"]) for g in status_as(None, daemon.socket)}
        assert {("held", f"uid {a.uid}"), ("tp0", f"uid {b.uid}"), ("bench", f"uid {b.uid}")} <= seen_by_root
        asked = b.run(
            [sys.executable, "-m", "nodecomm.tools.cli", "--socket", daemon.socket, "thresholds", "--group", "held"]
        )
        assert asked.returncode == 1 and f"uid {b.uid} has no active group named 'held'" in asked.stderr, asked.stderr
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(timeout=60)
        calibrated = nodecomm_cli("--socket", daemon.socket, "calibrate", "--min-bytes", "1KiB", "--max-bytes", "4KiB")
        # Its probe formed its group and measured (a busy machine may make it refuse the noise).
        assert calibrated.returncode == 0 or "were still noise" in calibrated.stderr, calibrated.stderr
    finally:
        squat.kill()
        squat.wait()
    report("another user squatting a job's group names", baseline, attacked)


_BIND_PORT = """
import socket, sys
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("bound", flush=True)
sys.stdin.readline()
"""
_HOLD_METRICS_CONNECTIONS = """
import socket, sys
port, held = int(sys.argv[1]), []
for i in range(2200):
    s = socket.create_connection(("127.0.0.1", port))
    if i >= 2000:
        s.sendall(b"GET /metrics HTTP/1.1\\r\\nX: " + b"y" * 100)  # a head that never ends
    held.append(s)
print("held", flush=True)
sys.stdin.readline()
"""


def test_metrics_stay_served_to_everyone_whatever_one_user_does(users, node_daemon):
    """3: user B holds 2,000 connections to /metrics that send nothing, and 200 more that send a
    request head without end: the daemon's threads stay where they were, and a scrape still gets
    its answer; B binding the metrics port before the daemon starts leaves the daemon serving
    groups and /metrics from the moment B lets go; B's group reporting made-up timings (1 s per
    1 KiB all-reduce) moves only series labelled with B's uid."""
    a, b, _ = users
    port = free_port()
    squatter = b.start(_BIND_PORT, str(port))
    assert squatter.stdout.readline().strip() == "bound"
    daemon = node_daemon("--metrics-address", f"127.0.0.1:{port}")
    daemon.metrics_port = port  # the flag given last wins over the one Daemon.start gives
    try:
        with pytest.raises(OSError):
            daemon.metrics_text()
        baseline = ordinary_group(a, daemon.socket, "port-taken")  # groups are served meanwhile
        squatter.stdin.write("\n")
        squatter.stdin.flush()
        squatter.wait(timeout=30)

        def metrics_served() -> bool:
            try:
                return bool(daemon.metrics_text())
            except OSError:
                return False

        wait_until(metrics_served, 30, "the daemon taking its metrics port once it was free")
        assert "metrics: cannot listen on 127.0.0.1" in daemon.log()
        pid = daemon.process.pid
        threads = _threads(pid)
        flood = b.start(_HOLD_METRICS_CONNECTIONS, str(port))
        try:
            assert flood.stdout.readline().strip() == "held"
            most = _threads(pid)
            scraped = daemon.metrics_text()
        finally:
            flood.kill()
            flood.wait()
        assert most <= threads + 2 and "nodecomm_groups" in scraped, (threads, most)
        poisoner = b.start(
            "import sys, nodecomm\nfrom nodecomm.v1 import control_pb2 as pb\n"
            "with nodecomm.connect('poison', 0, 1, socket=sys.argv[1], timeout=30) as comm:\n"
            "    fake = pb.Timing(path=pb.ONESHOT, bytes=1024, seconds=1.0)\n"
            "    comm._session._outbox.put(pb.SessionUp(timings=pb.TimingBatch(timings=[fake] * 32)))\n"
            "    print('sent', flush=True)\n"
            "    sys.stdin.readline()\n",
            daemon.socket,
        )

        def oneshot_seconds() -> dict[str, float]:  # per uid, of 1 KiB all-reduces
            return {
                line.split('uid="')[1].split('"')[0]: float(line.split()[-1])
                for line in daemon.metrics_text().splitlines()
                if line.startswith('nodecomm_operation_seconds_sum{op="all_reduce",path="oneshot",size_bucket="1KiB"')
            }

        try:
            assert poisoner.stdout.readline().strip() == "sent", poisoner.stderr.read()[-3000:]
            # Its session keeps the group until the daemon has taken the batch.
            wait_until(
                lambda: oneshot_seconds().get(str(b.uid), 0.0) >= 32.0,
                30,
                lambda: f"B's made-up timings taken ({oneshot_seconds()})",
            )
            poisoner.stdin.write("\n")
            poisoner.stdin.flush()
            poisoner.wait(timeout=60)
        finally:
            poisoner.kill()
            poisoner.wait()
        assert poisoner.returncode == 0, poisoner.stderr.read()[-3000:]
        sums = oneshot_seconds()
        assert sums[str(b.uid)] >= 32.0 and sums[str(a.uid)] < 1.0, sums
        attacked = ordinary_group(a, daemon.socket, "after")
    finally:
        squatter.kill()
    print(f"daemon threads {threads} before, {most} with 2,200 of B's connections to /metrics")
    report("metrics port taken, /metrics flooded, made-up timings", baseline, attacked)


_LIST_AS_MEMBER = """
import json, sys, grpc
from nodecomm.v1 import control_pb2 as pb, control_pb2_grpc as pb_grpc
with grpc.insecure_channel("unix:" + sys.argv[1]) as channel:
    stub = pb_grpc.ControlStub(channel)
    seen = {}
    for key in (b"", b"guess", b"the-key"):
        (group,) = [g for g in stub.ListGroups(pb.ListGroupsRequest(group_key=key), timeout=5).groups if g.name == "victim"]
        seen[key.decode()] = [group.world_size, list(group.joined_ranks)]
print(json.dumps(seen))
"""


def test_a_forming_group_cannot_be_taken_over(users, node_daemon):
    """1: while rank 1 of user A's keyed group is late, A's own other processes see its world size
    and joined ranks only with the key, and their Joins as rank 0 or 1 without the key or with a
    wrong one are refused before they change anything; user B does not see the group at all; the
    real ranks form it and reduce correctly."""
    daemon = node_daemon()
    a, b, _ = users
    baseline = ordinary_group(a, daemon.socket, "before")
    victims = a.start_ranks("legitimate_traffic", 2, daemon.socket, "victim", 100, "the-key", 6.0)
    wait_until(lambda: any(g["name"] == "victim" for g in status_as(a, daemon.socket)), 60, "the victim group forming")
    listed = a.python(_LIST_AS_MEMBER, daemon.socket)
    assert json.loads(listed.stdout) == {"": [0, []], "guess": [0, []], "the-key": [2, [0]]}, listed
    assert not any(g["name"] == "victim" for g in status_as(b, daemon.socket))
    for key in ("", "guess"):
        (refused,) = raw_joins(a, f"unix:{daemon.socket}", ["victim"], key=key)
        assert refused.startswith("PERMISSION_DENIED"), refused
        assert "group key is not the one the group's first Join carried" in refused, refused
    attacked = results(victims)
    late = attacked[1][0], max(r[1] for r in attacked)
    report("joins posing as a forming group's late rank", baseline, late)


_HALF_JOINS = """
import json, os, sys, grpc
from nodecomm.v1 import control_pb2 as pb, control_pb2_grpc as pb_grpc
from waiting import wait_until
def join(name):
    return pb.JoinRequest(group=name, rank=0, world_size=2, device="cpu", pid=os.getpid(),
        geometry=pb.Geometry(capacity_bytes=4096, dtypes=[pb.FLOAT32]), join_timeout_seconds=30)
with grpc.insecure_channel("unix:" + sys.argv[1]) as channel:
    stub = pb_grpc.ControlStub(channel)
    pending = [stub.Join.future(join(f"half-{i}"), timeout=40) for i in range(32)]
    joining = lambda: sum(g.state == "joining" for g in stub.ListGroups(pb.ListGroupsRequest(), timeout=5).groups)
    wait_until(lambda: joining() == 32, 30, lambda: f"B's 32 half-joined groups forming ({joining()})")
    try:
        stub.Join(join("half-32"), timeout=10)
        print("admitted", flush=True)
    except grpc.RpcError as error:
        print(error.code().name, error.details(), flush=True)
    sys.stdin.readline()
"""


def test_one_user_cannot_fill_the_daemon_with_forming_groups(users, node_daemon):
    """6: user B's half-joined groups stop at max_forming_groups_per_caller (32): the 33rd gets
    RESOURCE_EXHAUSTED naming B's uid, and user A's group still forms beside them."""
    daemon = node_daemon()
    a, b, _ = users
    baseline = ordinary_group(a, daemon.socket, "before")
    half = b.start(_HALF_JOINS, daemon.socket)
    try:
        answer = half.stdout.readline().strip()
        attacked = ordinary_group(a, daemon.socket, "during")
    finally:
        half.kill()
        half.wait()
    assert answer.startswith("RESOURCE_EXHAUSTED"), answer or half.stderr.read()[-3000:]
    assert f"uid {b.uid} already started 32 groups that are still forming" in answer, answer
    report("32 half-joined groups from one user", baseline, attacked)


_SILENT = """
import socket, sys
count = int(sys.argv[3])
held = []
for target in sys.argv[1:3]:
    for _ in range(count):
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(target)
        held.append(connection)
print("held", flush=True)
sys.stdin.readline()
"""


def test_silent_connections_neither_exhaust_descriptors_nor_threads(users, node_daemon):
    """5: user B holds 2,000 connections to each socket that never send a byte: the control
    socket takes 256 of them (max_connections_per_caller) and closes those once gRPC's 3 s
    handshake deadline passes, the rest at once or after answering why; the descriptor socket
    serves them from one thread and closes each after 2 s. User A's group connects and runs
    meanwhile, and the daemon's descriptors and threads come back to where they were."""
    daemon = node_daemon()
    a, b, _ = users
    baseline = ordinary_group(a, daemon.socket, "before")
    pid = daemon.process.pid
    before = resources(pid)
    silent = b.start(_SILENT, daemon.socket, daemon.descriptor_socket, "2000")
    try:
        assert silent.stdout.readline().strip() == "held"
        most = resources(pid)
        attacked = ordinary_group(a, daemon.socket, "during")
        wait_until(
            lambda: _open_descriptors(pid) <= before["fds"] + 16,
            30,
            lambda: f"the daemon's descriptors back within 16 of {before['fds']} (now {_open_descriptors(pid)})",
        )
    finally:
        silent.kill()
        silent.wait()
    assert most["threads"] <= before["threads"] + 8, (before, most)
    print(f"daemon before / with 4000 silent connections: {before} / {most}")
    report("4000 silent connections", baseline, attacked)


# -- what held already, as the earlier review found it --------------------------------------------------


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
    good = json.loads(_calibration(0.0, 4096))
    key = good["key"]
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
        assert identify_as_nobody(daemon.descriptor_socket) == "no error"  # admitted while it may open it
        os.chmod(daemon.descriptor_socket, 0o600)
        answer = identify_as_nobody(daemon.descriptor_socket)
        assert (
            answer
            == f"DaemonUnavailableError descriptor socket {daemon.descriptor_socket}: [Errno 13] Permission denied"
        )
        report(
            "a caller the descriptor socket refuses", baseline, legitimate_group(spawn_ranks, daemon.socket, "after")
        )
    finally:
        daemon.stop(signal.SIGKILL)
        shutil.rmtree(open_directory, ignore_errors=True)


def test_a_killed_calibration_leaves_no_process(make_daemon, spawn_ranks, tmp_path):
    """8: the probe's table comes back on its output; once the daemon is killed mid-probe, the
    probe (a bench in a session of its own, which its output's pipe to the daemon ties to it)
    ends too. An ordinary group runs beside the probe."""
    daemon = make_daemon("--state-dir", str(tmp_path / "state"))
    baseline = legitimate_group(spawn_ranks, daemon.socket, "before")
    calibrate = subprocess.Popen(
        [sys.executable, "-m", "nodecomm.tools.cli", "--socket", daemon.socket, "calibrate", "--max-bytes", "64MiB"],
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
    wait_until(
        lambda: not processes_naming(daemon.socket), 60, lambda: f"the probe gone: {processes_naming(daemon.socket)}"
    )
    report("a calibration killed mid-probe", baseline, attacked)


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


def _dropped(daemon, reason: str) -> float:
    text = daemon.metrics_text()
    return float(text.split(f'nodecomm_timings_dropped_total{{reason="{reason}"}} ')[1].split()[0])


_TIME_GET_THRESHOLDS = """
import statistics, sys, time
import grpc
from nodecomm.v1 import control_pb2 as pb, control_pb2_grpc as pb_grpc
with grpc.insecure_channel("unix:" + sys.argv[1]) as channel:
    stub = pb_grpc.ControlStub(channel)
    stub.GetThresholds(pb.GetThresholdsRequest(group=sys.argv[2]), timeout=10)
    print("ready", flush=True)
    sys.stdin.readline()
    seconds, until = [], time.monotonic() + 1.0
    while time.monotonic() < until:
        started = time.perf_counter()
        stub.GetThresholds(pb.GetThresholdsRequest(group=sys.argv[2]), timeout=10)
        seconds.append(time.perf_counter() - started)
    print(statistics.median(seconds), max(seconds))
"""


def _get_thresholds_seconds(daemon, meanwhile=lambda: None, group: str = "flood-many") -> tuple[float, float]:
    """GetThresholds' median and longest time per call (for root's `group`; "": a new group's) over
    a second of calls that start right after meanwhile() returns, from a process of its own: the
    flooding clients of this one would
    otherwise slow the caller, not the daemon."""
    timer = subprocess.Popen(
        [sys.executable, "-c", _TIME_GET_THRESHOLDS, daemon.socket, group],
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
                huge_flooder._session._outbox.put(huge)  # what a modified client could send
            for _ in range(100):
                flooder._session._outbox.put(large)
            for _ in range(2000):
                flooder._session._outbox.put(small)

        flooded = _get_thresholds_seconds(daemon, flood)
        attacked = legitimate_group(spawn_ranks, daemon.socket, "during")
        wait_until(
            lambda: _dropped(daemon, "batch") >= 100_000 and _dropped(daemon, "rate") >= 32 * 100,
            60,
            lambda: (
                f"timings dropped by batch and by rate (now {_dropped(daemon, 'batch')}, {_dropped(daemon, 'rate')})"
            ),
        )
        # Read at the session's pace: never more messages than a second's burst and the rate since.
        read = 100 + _dropped(daemon, "rate") / 32
        pace = session_messages_per_second(DaemonConfig().timing_rate_per_rank)
        assert read <= pace * (time.monotonic() - flood_started[0] + 1), (read, pace)
        wait_until(lambda: huge_flooder._session.lost_reason is not None, 60, "the 3.6 MB batches ending their session")
        assert not flooder._session.lost_reason
    print(
        f"GetThresholds: {quiet[0] * 1e3:.2f} ms per call quiet (longest {quiet[1] * 1e3:.1f}), "
        f"{flooded[0] * 1e3:.2f} ms during the flood's first second (longest {flooded[1] * 1e3:.1f})"
    )
    report("sessions flooding timings", baseline, attacked)


# -- 9. every daemon a rank uses is one it resolved and checked; every claim is bound to its uid -------

_LISTEN = """
import socket, sys, threading
listener = socket.socket()
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen()
heard = []
def accept():
    while True:
        heard.append(listener.accept()[0])
threading.Thread(target=accept, daemon=True).start()
print("listening", flush=True)
sys.stdin.readline()
print(len(heard), flush=True)
"""


def heard(listener: subprocess.Popen) -> int:
    """How many connections the _LISTEN process of another user accepted, once it is told to stop."""
    out, _ = listener.communicate("\n", timeout=60)
    return int(out.split()[-1])


_STORE_ANNOUNCER = _LISTEN.replace(
    'print("listening", flush=True)',
    """from datetime import timedelta
import json
import torch.distributed as dist
from nodecomm.client.hierarchical import node_name
store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), 2, True, timedelta(seconds=120), wait_for_workers=False)
# What the victim job's rank 0 writes, first: its node's name, and a daemon of the attacker's.
store.set("0//cpu//nodecomm/node/1/0", json.dumps([node_name(None), "elsewhere", 1, 1]))
store.set("0//cpu//nodecomm/group/1", f"0123456789ab {'7' * 32} node ipv4:127.0.0.1:{sys.argv[1]}")
print("listening", flush=True)
while line := sys.stdin.readline().strip():  # each line: another announcement; an empty one ends it
    store.set("0//cpu//nodecomm/group/1", line)
    print("announced", flush=True)""",
).replace("sys.stdin.readline()\nprint(len(heard)", "print(len(heard)")
_STORE_RANK = """
import sys, torch, torch.distributed as dist, nodecomm.distributed
from datetime import timedelta
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timedelta(seconds=60))
try:
    dist.init_process_group("nodecomm", store=store, rank=1, world_size=2, timeout=timedelta(seconds=60))
    x = torch.ones(4)
    dist.all_reduce(x)
    print("reduced", x.tolist(), nodecomm.distributed.daemon())
except Exception as error:
    print(type(error).__name__, error)
"""


def test_a_daemon_announced_in_the_job_store_is_never_dialled(users, node_daemon):
    """9: user B reaches user A's job's c10d store first (the store has no authentication) and
    announces, as rank 0 would, a "node daemon" at a TCP port of B's. A's rank 1 resolves its
    daemon itself (the node daemon at NODECOMM_SOCKET), finds the announcement differs, and stops
    with a GroupMismatchError naming both; B's port never hears from it."""
    daemon = node_daemon()
    a, b, _ = users
    baseline = ordinary_group(a, daemon.socket, "before")
    fake, store_port = free_port(), free_port()
    attacker = b.start(_STORE_ANNOUNCER, str(fake), str(store_port), env={"NODECOMM_SOCKET": daemon.socket})
    try:
        assert attacker.stdout.readline().strip() == "listening", attacker.stderr.read()
        victim = a.python(_STORE_RANK, str(store_port), env={"NODECOMM_SOCKET": daemon.socket})
        attacker.stdin.write("garbage\n")
        attacker.stdin.flush()
        assert attacker.stdout.readline().strip() == "announced"
        garbled = a.python(_STORE_RANK, str(store_port), env={"NODECOMM_SOCKET": daemon.socket})
    finally:
        connections = heard(attacker)
    expected = (
        f"GroupMismatchError [rank 1] rank 0 announced the daemon 'node ipv4:127.0.0.1:{fake}' in the job's c10d "
        f"store, but this rank resolved 'node {daemon.socket}'"
    )
    assert victim.stdout.startswith(expected), (victim.stdout, victim.stderr[-3000:])
    assert garbled.stdout.startswith(
        "GroupMismatchError [rank 1] the job's c10d store holds 'garbage' where rank 0 announces the group"
    ), (garbled.stdout, garbled.stderr[-3000:])
    assert connections == 0
    report("a daemon announced in the job's store by another user", baseline, ordinary_group(a, daemon.socket, "after"))


def test_a_tcp_daemon_proves_who_it_is_before_a_rank_sends_it_anything(users, node_daemon, request):
    """9: A's ranks reach the node daemon's loopback TCP port (root's listening socket), and its
    TLS port with the operator's certificate authority in NODECOMM_DAEMON_CA. A port user B listens
    on is refused before a byte is sent, naming B's uid; a TCP target that is neither loopback nor
    TLS is refused saying how to configure one; a TLS daemon of B's own, whose certificate the
    operator's authority did not sign, fails the handshake and hears no Join."""
    a, b, _ = users
    certificates = Path(tempfile.mkdtemp(prefix="nodecomm-certificates-"))  # where A can read the authority
    certificates.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(certificates, ignore_errors=True))
    cert, key = self_signed(certificates)
    cert.chmod(0o644)
    port, tls_port, fake, fake_tls = free_port(), free_port(), free_port(), free_port()
    daemon = node_daemon("--tcp-address", f"127.0.0.1:{port}")
    node_daemon("--tcp-address", f"127.0.0.1:{tls_port}", "--tls-cert", str(cert), "--tls-key", str(key))
    baseline = ordinary_group(a, daemon.socket, "before")
    plain = ordinary_group(a, f"ipv4:127.0.0.1:{port}", "over-tcp", "k")
    secured = ordinary_group(a, f"ipv4:127.0.0.1:{tls_port}", "over-tls", "k", env={"NODECOMM_DAEMON_CA": str(cert)})
    connect = (
        "import sys, nodecomm\n"
        "try:\n    nodecomm.connect('tp0', 0, 1, socket=sys.argv[1], timeout=10, group_key='k')\n"
        "except nodecomm.NodecommError as error:\n    print(type(error).__name__, error)\n"
    )
    listener = b.start(_LISTEN, str(fake))
    try:
        assert listener.stdout.readline().strip() == "listening"
        squatted = a.python(connect, f"ipv4:127.0.0.1:{fake}")
        named = a.python(connect, f"dns:localhost:{fake}")
    finally:
        connections = heard(listener)
    assert squatted.stdout.startswith(
        f"PermissionDeniedError [group 'tp0', rank 0] 127.0.0.1:{fake} is served by a socket of uid {b.uid}"
    ), squatted
    assert named.stdout.startswith("PermissionDeniedError") and "cannot prove who it is" in named.stdout, named
    assert "NODECOMM_DAEMON_CA=" in named.stdout
    assert connections == 0
    in_the_clear = a.python(connect, f"ipv4:127.0.0.1:{tls_port}")  # the operator's TLS port, without its authority
    assert in_the_clear.stdout.startswith("DaemonUnavailableError"), in_the_clear
    assert "where it serves TLS, set NODECOMM_DAEMON_CA" in in_the_clear.stdout
    b_certificates = b.home / "certificates"
    b.run(["mkdir", "-m", "700", str(b_certificates)])
    b_cert, b_key = self_signed(b_certificates)
    for path in (b_cert, b_key):
        os.chown(path, b.uid, b.uid)
    impostor = start_as(
        b, str(b.home / "nodecomm.sock"), "--tcp-address", f"127.0.0.1:{fake_tls}", "--tls-cert", str(b_cert),
        "--tls-key", str(b_key),
    )  # fmt: skip
    try:
        fooled = a.python(connect, f"ipv4:127.0.0.1:{fake_tls}", env={"NODECOMM_DAEMON_CA": str(cert)})
    finally:
        seen = what_it_saw(impostor)
    assert fooled.stdout.startswith("DaemonUnavailableError"), fooled
    assert "CERTIFICATE_VERIFY_FAILED" in fooled.stdout or "handshake" in fooled.stdout.lower(), fooled.stdout
    assert "group formed" not in seen and "join" not in seen.lower(), seen[-3000:]
    print(f"over loopback TCP: connect {plain[0] * 1e3:.0f} ms, p50 {plain[1] * 1e6:.1f} us")
    print(f"over TLS: connect {secured[0] * 1e3:.0f} ms, p50 {secured[1] * 1e6:.1f} us")
    report("a TCP port another user listens on", baseline, ordinary_group(a, daemon.socket, "after"))


_JOIN_DECLARING = """
import sys, grpc
from nodecomm.v1 import control_pb2 as pb, control_pb2_grpc as pb_grpc
target, pid = sys.argv[1], int(sys.argv[2])
request = pb.JoinRequest(group=f"borrowed-{pid}", rank=0, world_size=1, device="cpu", pid=pid, join_timeout_seconds=5,
    geometry=pb.Geometry(capacity_bytes=4096, dtypes=[pb.FLOAT32]), group_key=b"k")
with grpc.insecure_channel(target) as channel:
    try:
        print("ok", pb_grpc.ControlStub(channel).Join(request, timeout=30).claim_token.hex())
    except grpc.RpcError as error:
        print(error.code().name, error.details())
"""
_BECOME_AND_CLAIM = """
import os, sys
from nodecomm.client.descriptors import claim_descriptors
joiner, claimant, group, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.setgroups([group])
os.setresgid(joiner, joiner, 0)
os.setresuid(joiner, joiner, 0)  # a process of the joiner's, which can take root back (saved uid 0)
print(os.getpid(), flush=True)
token = bytes.fromhex(sys.stdin.readline())
os.seteuid(0)
os.setresgid(claimant, claimant, claimant)
os.setresuid(claimant, claimant, claimant)  # now the claimant's, the same pid
try:
    print("claimed", len(claim_descriptors(path, token, 8, 5.0)))
except PermissionError as error:
    print("refused", error)
"""


def test_a_join_declares_its_own_uids_process_and_a_claim_goes_to_that_uid_only(users, node_daemon):
    """9: user B Joins declaring the pid of a process of user A's, over the Unix socket and over
    loopback TCP: both are refused, naming A's uid, before any group forms (a daemon that relayed
    A's Joins as B got A's ranks B's memory so). And a claim is bound to the uid that joined, not
    only to the pid: a process that was B's when B joined for it and is A's when it claims (the
    same pid, as after pid reuse) is refused."""
    port = free_port()
    daemon = node_daemon("--tcp-address", f"127.0.0.1:{port}")
    a, b, _ = users
    baseline = ordinary_group(a, daemon.socket, "before")
    victim = a.start("import sys\nsys.stdin.readline()\n")
    try:
        over_unix = b.python(_JOIN_DECLARING, f"unix:{daemon.socket}", str(victim.pid)).stdout
        over_tcp = b.python(_JOIN_DECLARING, f"ipv4:127.0.0.1:{port}", str(victim.pid)).stdout
    finally:
        victim.kill()
        victim.wait()
    for answer in (over_unix, over_tcp):
        assert answer.startswith("PERMISSION_DENIED"), answer
        assert f"declares pid {victim.pid}, which runs as uid {a.uid}, but it comes from uid {b.uid}" in answer
    changeling = subprocess.Popen(
        [sys.executable, "-c", _BECOME_AND_CLAIM, str(b.uid), str(a.uid), str(SOCKET_GID), daemon.descriptor_socket],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        pid = int(changeling.stdout.readline())
        joined = b.python(_JOIN_DECLARING, f"unix:{daemon.socket}", str(pid)).stdout
        assert joined.startswith("ok "), joined
        out, err = changeling.communicate(joined.split()[1] + "\n", timeout=60)
    finally:
        changeling.kill()
    assert out.startswith("refused claim for group"), (out, err)
    assert f"was issued to uid {b.uid}, who joined, but uid {a.uid} (pid {pid}) presented it" in out
    report("Joins declaring another user's pid", baseline, ordinary_group(a, daemon.socket, "after"))


def _calibration(measured_at: float, oneshot_max_bytes: int) -> str:
    """A valid calibration of this machine's CPU fingerprint."""
    fingerprint = cpu_fingerprint()
    return json.dumps(
        {
            "key": fingerprint_key(fingerprint),
            "fingerprint": fingerprint,
            "boundaries": {"oneshot_max_bytes": oneshot_max_bytes},
            "medians": {"oneshot": {"1024": 1e-5}, "twoshot": {"1024": 2e-5}},
            "measured_at": measured_at,
        }
    )


_PRIVATE_TABLE = """
import os, sys, nodecomm
with nodecomm.connect(sys.argv[1], 0, 1, daemon="private", timeout=60) as comm:  # a job of its own
    print(comm.thresholds().rows())
    print(open(os.path.join(os.path.dirname(comm.daemon.socket), "daemon.log")).read())
"""


@pytest.mark.skipif(os.path.exists("/var/lib/nodecomm"), reason="a private daemon reads /var/lib/nodecomm instead")
def test_a_state_directory_another_user_made_is_not_read(users):
    """9: user B makes a state directory (0755) holding a valid calibration of this machine that
    sends only sizes up to 100 bytes to oneshot. A's private daemon, with XDG_STATE_HOME there, and
    a node daemon run as A (a dedicated user) with state_dir there both ignore it, naming the
    directory and its owner, and serve the built-in table."""
    a, b, _ = users
    state = Path(tempfile.mkdtemp(prefix="nodecomm-state-"))
    state.chmod(0o1777)  # as /tmp is
    try:
        made = b.run(["mkdir", "-m", "755", str(state / "b"), str(state / "b" / "nodecomm")])
        assert made.returncode == 0, made.stderr
        planted = state / "b" / "nodecomm" / f"calibration-{fingerprint_key(cpu_fingerprint())}.json"
        planted.write_text(_calibration(time.time() - 60, 100))
        os.chown(planted, b.uid, b.uid)
        runtime = a.home / "run"
        a.run(["mkdir", "-m", "700", str(runtime)])
        own = a.python(_PRIVATE_TABLE, "own", env={"XDG_RUNTIME_DIR": str(runtime)})
        planted_in = a.python(
            _PRIVATE_TABLE, "planted", env={"XDG_RUNTIME_DIR": str(runtime), "XDG_STATE_HOME": str(state / "b")}
        )
        assert own.returncode == 0 and planted_in.returncode == 0, (own.stderr[-3000:], planted_in.stderr[-3000:])
        default_rows = own.stdout.splitlines()[0]
        assert planted_in.stdout.splitlines()[0] == default_rows and "(0, 100," not in default_rows
        refusal = (
            f"ignoring the calibration in {planted}: {state / 'b'} belongs to uid {b.uid}, not to you (uid {a.uid})"
        )
        assert refusal in planted_in.stdout, planted_in.stdout[-3000:]
        node = start_as(a, str(a.home / "node" / "nodecomm.sock"), "--state-dir", str(planted.parent))
        try:
            shown = a.run(
                [sys.executable, "-m", "nodecomm.tools.cli", "--socket", str(a.home / "node" / "nodecomm.sock"),
                 "thresholds"]
            ).stdout  # fmt: skip
        finally:
            seen = what_it_saw(node)
        assert "(calibrated)" not in shown and "(default)" in shown, shown
        assert f"ignoring the calibration in {planted}: {state / 'b'} belongs to uid {b.uid}" in seen, seen[-3000:]
    finally:
        shutil.rmtree(state)


def test_a_calibration_from_the_future_is_refused(make_daemon, spawn_ranks, tmp_path):
    """9: a calibration whose measured_at is a year ahead (it would outrank every calibration
    measured until then) is ignored, with the log saying so, whoever wrote it: the daemon serves
    the built-in boundaries; the same file measured a minute ago is used."""
    state = tmp_path / "state"
    state.mkdir()
    path = state / f"calibration-{fingerprint_key(cpu_fingerprint())}.json"
    path.write_text(_calibration(time.time() - 60, 4096))
    daemon = make_daemon("--state-dir", str(state))
    assert "oneshot_max_bytes=4KiB (calibrated)" in nodecomm_cli("--socket", daemon.socket, "thresholds").stdout
    baseline = legitimate_group(spawn_ranks, daemon.socket, "before")
    daemon.stop()
    path.write_text(_calibration(time.time() + 365 * 86400, 4096))
    daemon = make_daemon("--state-dir", str(state))
    shown = nodecomm_cli("--socket", daemon.socket, "thresholds").stdout
    assert "(calibrated)" not in shown and "(default)" in shown, shown
    assert f"ignoring the calibration in {path}: it says it was measured 315" in daemon.log(), daemon.log()[-3000:]
    assert "a calibration from the future is refused" in daemon.log()
    report("a calibration from the future", baseline, legitimate_group(spawn_ranks, daemon.socket, "after"))


def test_sessions_sending_1_mib_batches_cost_another_user_nothing(users, node_daemon):
    """9: user B's 40 one-rank groups each send 10 batches of 60,000 timings (960 KB, under the
    daemon's 1 MiB message bound) at once. Each is refused before it is parsed (past the most a
    session message may be), ending B's session, so another user's GetThresholds stays within
    twice its quiet median, and A's group runs."""
    daemon = node_daemon()
    a, b, _ = users
    baseline = ordinary_group(a, daemon.socket, "before")
    flooder = b.start(_FLOOD_SESSIONS, daemon.socket, "40", "60000", "10")
    try:
        assert flooder.stdout.readline().strip() == "connected", flooder.stderr.read()
        quiet = _get_thresholds_seconds(daemon, group="")

        def flood() -> None:
            flooder.stdin.write("go\n")
            flooder.stdin.flush()

        flooded = _get_thresholds_seconds(daemon, flood, group="")
        print(f"GetThresholds: {quiet[0] * 1e3:.2f} ms quiet, {flooded[0] * 1e3:.2f} ms during B's 960 KB batches")
        assert flooded[0] <= 2 * quiet[0], (quiet, flooded)
        assert flooder.stdout.readline().strip() == "sent"
        attacked = ordinary_group(a, daemon.socket, "during")
        wait_until(lambda: _lost_sessions(flooder) == 40, 60, "B's 40 sessions ending on their first batch")
    finally:
        flooder.kill()
        flooder.wait()
    report("40 sessions sending 960 KB batches", baseline, attacked)
