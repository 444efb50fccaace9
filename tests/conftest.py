"""Shared harness: a real daemon on a temporary socket, and rank processes against one deadline."""

from __future__ import annotations

import collections
import faulthandler
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from nodecomm.client.daemon_process import answers, start_daemon
from nodecomm.credentials import rank_metadata
from nodecomm.socket_path import descriptor_socket_path, grpc_target
from nodecomm.tools.ranks import RankProcesses, free_port  # free_port: the tests take it from here
from nodecomm.v1 import control_pb2 as pb
from nodecomm.v1 import control_pb2_grpc as pb_grpc
from waiting import wait_until


def cuda_available() -> bool:
    from nodecomm import _native

    if not _native.WITH_CUDA:
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and a CUDA build of nodecomm._native")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# pytest-timeout's alarm cannot break a wait inside C code (a deadlock in a library's fork
# handler once hung a CI run past its 90 minutes): this long after a test's own timeout, the run
# ends with every thread's stack instead. faulthandler's watchdog is a C thread, needing no GIL.
HUNG_AFTER_TIMEOUT_SECONDS = 300


_STACKS_TO = pytest.StashKey()
_CACHE = pytest.StashKey()


def pytest_configure(config):
    # Capture is suspended here: this is the run's real standard error.
    config.stash[_STACKS_TO] = os.fdopen(os.dup(2), "w")
    # No private daemon a test starts reads or writes the user's own calibration cache.
    os.environ["XDG_CACHE_HOME"] = config.stash[_CACHE] = tempfile.mkdtemp(prefix="nodecomm-test-cache-")
    # Exploration moves tables by what this machine measures: the tests that assert a table run
    # without it, and those of exploration and convergence ask for it.
    os.environ["NODECOMM_EXPLORE_PERIOD"] = "0"


def pytest_unconfigure(config):
    if _CACHE in config.stash:  # the run's calibration cache goes with it
        shutil.rmtree(config.stash[_CACHE], ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    marker = item.get_closest_marker("timeout")
    timeout = float(marker.args[0]) if marker and marker.args else float(item.config.getini("timeout") or 0)
    if timeout > 0:
        stacks_to = item.config.stash[_STACKS_TO]
        faulthandler.dump_traceback_later(timeout + HUNG_AFTER_TIMEOUT_SECONDS, exit=True, file=stacks_to)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@dataclass
class Daemon:
    """nodecommd as a subprocess. `start()` blocks until its health service says SERVING."""

    directory: Path
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    metrics_port: int = 0
    starts: int = 0

    @property
    def socket(self) -> str:
        return str(self.directory / "nodecomm.sock")

    @property
    def descriptor_socket(self) -> str:
        return descriptor_socket_path(self.socket)

    @property
    def log_path(self) -> Path:
        return self.directory / f"daemon-{self.starts}.log"

    def start(self, timeout: float = 30.0) -> Daemon:
        self.starts += 1
        self.metrics_port = free_port()
        flags = ["--metrics-address", f"127.0.0.1:{self.metrics_port}", "--log-level", "DEBUG"]
        flags += ["--state-dir", str(self.directory / "state"), "--cache-dir", str(self.directory / "cache")]
        flags += ["--explore-period", "0"]  # as NODECOMM_EXPLORE_PERIOD (pytest_configure) says
        flags += self.extra_args
        self.process = start_daemon(
            self.socket, *flags, log_path=str(self.log_path), env={**os.environ, **self.env}, timeout=timeout
        )
        return self

    def healthy(self, timeout: float = 2.0) -> bool:
        return answers(self.socket, timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is not None:
            return self.process.returncode
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise

    def metrics_text(self) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()

    def metric(self, series: str) -> float:
        """One series' value as the daemon exposes it now, e.g.
        'nodecomm_rpc_seconds_count{method="Submit"}'; 0.0 while it has none (a labelled counter
        appears at its first count)."""
        for line in self.metrics_text().splitlines():
            name, _, value = line.rpartition(" ")
            if name == series:
                return float(value)
        return 0.0

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


@pytest.fixture
def daemon(tmp_path: Path):
    instance = Daemon(tmp_path).start()
    try:
        yield instance
    finally:
        instance.stop(signal.SIGKILL)


@pytest.fixture
def make_daemon(tmp_path: Path):
    """A daemon factory for tests that need flags or environment of their own."""
    made: list[Daemon] = []

    def make(*extra_args: str, env: dict[str, str] | None = None) -> Daemon:
        instance = Daemon(tmp_path / f"d{len(made)}", list(extra_args), env or {})
        instance.directory.mkdir()
        made.append(instance)
        return instance.start()

    try:
        yield make
    finally:
        for instance in made:
            instance.stop(signal.SIGKILL)


@pytest.fixture
def spawn_ranks():
    """spawn_ranks(target, world_size, *args, timeout=...) -> RankProcesses (nodecomm.tools.ranks);
    survivors are killed afterwards."""
    started: list[RankProcesses] = []

    def spawn(target: Callable, ranks: int | list[int], *args, timeout: float = 120.0) -> RankProcesses:
        group = RankProcesses.start(target, ranks, *args, timeout=timeout)
        started.append(group)
        return group

    try:
        yield spawn
    finally:
        for group in started:
            group.close()


def kill_at_work(group: RankProcesses, report, victim: int = 1, timeout: float = 60.0) -> tuple[list, dict]:
    """How the peer-loss tests kill a rank: once every rank of `group` has put its word on `report`
    (it is at work), SIGKILL to `victim`, then every rank's result. Returns the words as they came
    and the results; the victim's is "died"."""
    words = [report.get(timeout=timeout) for _ in group.processes]
    group.kill(victim, signal.SIGKILL)
    results = group.results()
    assert results[victim][0] == "died", results[victim]
    return words, results


def restart_under_ranks(daemon: Daemon, commands: list, while_down: Callable[[], object] = lambda: None) -> None:
    """How the adoption tests restart a daemon under running ranks (tests/restart_ranks.py's
    `adopted`): SIGKILL, "daemon gone" to every rank's queue, `while_down()` while no daemon serves,
    the next daemon on the same socket and state, "next daemon serving" to every rank's queue."""
    daemon.stop(signal.SIGKILL)
    for queue in commands:
        queue.put("daemon gone")
    while_down()
    daemon.start()
    for queue in commands:
        queue.put("next daemon serving")


def as_user(uid: int, gid: int, question: str, path: str) -> bytes:
    """What a process of uid/gid (no supplementary groups) gets asking `question` of the descriptor
    socket at `path` (tests/as_user.py says which questions there are)."""
    answer = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("as_user.py")), str(uid), str(gid), question, path],
        capture_output=True, timeout=60, check=True,
    )  # fmt: skip
    return answer.stdout


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1, signed by itself, and its key: (cert.pem, key.pem)
    in `directory`."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


# -- raw control-plane helpers -------------------------------------------------------------------


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class RankSecrets(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """What the client does for tests that speak raw gRPC: remembers the secret each Join reply
    gives its (group_id, rank), and sends it with that rank's later calls."""

    def __init__(self) -> None:
        self.secrets: dict[tuple[int, int], bytes] = {}

    def _with_secret(self, details: grpc.ClientCallDetails, group_id, rank) -> grpc.ClientCallDetails:
        secret = self.secrets.get((group_id, rank))
        if secret is None:
            return details
        metadata = [*(details.metadata or ()), *rank_metadata(secret)]
        return _CallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready, details.compression
        )

    def intercept_unary_unary(self, continuation, details, request):
        if details.method.endswith("/Join"):
            outcome = continuation(details, request)

            def remember(done) -> None:
                if done.exception() is None:
                    self.secrets[(done.result().group_id, request.rank)] = done.result().rank_secret

            outcome.add_done_callback(remember)
            return outcome
        group_id, rank = getattr(request, "group_id", None), getattr(request, "rank", None)
        return continuation(self._with_secret(details, group_id, rank), request)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        first = next(request_iterator, None)  # a Session's hello names the rank
        hello = getattr(first, "hello", None)
        if hello is not None:
            details = self._with_secret(details, hello.group_id, hello.rank)
        rest = itertools.chain([first], request_iterator) if first is not None else iter(())
        return continuation(details, rest)


def rank_channel(socket_path: str) -> grpc.Channel:
    """A channel that carries each joined rank's secret on its later calls (RankSecrets)."""
    return grpc.intercept_channel(grpc.insecure_channel(grpc_target(socket_path)), RankSecrets())


def stub_for(daemon):
    channel = rank_channel(daemon.socket)
    return channel, pb_grpc.ControlStub(channel)


def join_request(
    group="g",
    rank=0,
    world_size=2,
    capacity=1 << 20,
    dtypes=(pb.FLOAT32,),
    timeout=5.0,
    pid=None,
    device="cpu",
    nccl=False,
    wire=pb.LOSSLESS,
):
    return pb.JoinRequest(
        group=group,
        rank=rank,
        world_size=world_size,
        device=device,
        nccl_fallback=nccl,
        geometry=pb.Geometry(capacity_bytes=capacity, dtypes=dtypes, wire=wire),
        pid=pid or os.getpid(),
        join_timeout_seconds=timeout,
    )


def reserved_bytes(daemon) -> float:
    line = next(
        row for row in daemon.metrics_text().splitlines() if row.startswith('nodecomm_reserved_bytes{kind="host"}')
    )
    return float(line.split()[-1])


# -- other local users ----------------------------------------------------------------------------

# Uids and a socket group that no one on a test machine has: the tests act as these users.
SOCKET_GID = 41000
USER_UIDS = (41001, 41002, 41003)


@dataclass(frozen=True)
class User:
    """A local user the test acts as (it runs as root): a uid without a name, its own home (0700),
    its groups. Its processes run this Python with nothing of the test's environment but what
    `env` adds (no XDG_RUNTIME_DIR unless given)."""

    uid: int
    home: Path
    groups: tuple[int, ...] = ()

    def environment(self, **extra: str) -> dict[str, str]:
        base = {"HOME": str(self.home), "PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin", "LANG": "C.UTF-8"}
        base.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        return {**base, **extra}

    def popen(self, args: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        # setpriv drops to the uid in the new process: Popen(user=...) would fork() this one, whose
        # gRPC fork handler can wait for good on gRPC's timer thread (seen on a busy 2-core
        # machine); without user= Popen uses vfork(), which runs no fork handlers.
        groups = f"--groups={','.join(map(str, self.groups))}" if self.groups else "--clear-groups"
        command = ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", groups, "--", *args]
        return subprocess.Popen(command, cwd=self.home, env=self.environment(**(env or {})), **kwargs)

    def run(
        self, args: list[str], env: dict[str, str] | None = None, timeout: float = 180
    ) -> subprocess.CompletedProcess:
        with self.popen(args, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
            try:
                out, err = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate()
                raise AssertionError(f"uid {self.uid}: {args} did not end within {timeout} s: {out}{err}") from None
        return subprocess.CompletedProcess(args, process.returncode, out, err)

    def start(self, code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """`code` started by this Python as this user, with tests/ importable, text pipes on its
        standard streams."""
        return self.popen(
            [sys.executable, "-c", code, *args], {"PYTHONPATH": str(TESTS), **(env or {})},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def python(self, code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 180):
        """`code` run by this Python as this user, with tests/ importable."""
        return self.run([sys.executable, "-c", code, *args], {"PYTHONPATH": str(TESTS), **(env or {})}, timeout)

    def start_ranks(self, function: str, world_size: int, *args, env: dict[str, str] | None = None) -> subprocess.Popen:
        """ranks.`function` started in `world_size` processes of this user (tests/user_ranks.py),
        with `env` added to their environment; `results` collects what they return."""
        command = [sys.executable, str(TESTS / "user_ranks.py"), function, str(world_size), json.dumps(list(args))]
        return self.popen(
            command, {"PYTHONPATH": str(TESTS), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip

    def ranks(self, function: str, world_size: int, *args, env: dict[str, str] | None = None, timeout: float = 180):
        """ranks.`function` run by `world_size` processes of this user: each rank's return value."""
        return results(self.start_ranks(function, world_size, *args, env=env), timeout)


def results(ranks: subprocess.Popen, timeout: float = 180) -> list:
    """Each rank's return value from User.start_ranks' processes, or RankErrors with every
    failing rank's error."""
    try:
        out, err = ranks.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        ranks.kill()
        out, err = ranks.communicate()
    lines = out.strip().splitlines()
    outcome = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {"errors": [err[-3000:]]}
    if "errors" in outcome:
        raise RankErrors(outcome["errors"])
    return outcome["results"]


class RankErrors(AssertionError):
    """Ranks run as another user failed: `errors` holds each failing rank's "rank N: Class: message"."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


TESTS = Path(__file__).resolve().parent


def _open_for_traversal(paths: list[str]) -> list[tuple[str, int]]:
    """Give others search (x) permission on every directory above `paths` that lacks it; returns
    what was changed, to restore."""
    changed = []
    for path in paths:
        parts = Path(os.path.realpath(path)).parents
        for directory in parts:
            mode = os.stat(directory).st_mode
            if not mode & 0o001:
                os.chmod(directory, mode | 0o001)
                changed.append((str(directory), mode))
    return changed


def _running_as(uids: tuple[int, ...]) -> list[int]:
    """Pids of live processes (zombies aside) whose real uid is one of `uids`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = dict(line.split(":\t", 1) for line in (entry / "status").read_text().splitlines())
            except (OSError, ValueError):
                continue  # gone meanwhile
            if int(status["Uid"].split()[0]) in uids and not status["State"].startswith("Z"):
                found.append(int(entry.name))
    return found


@pytest.fixture(scope="session")
def python_for_everyone():
    """Other uids must run this Python and import this checkout: where a directory above them
    keeps them out (root's home is 0700 on the CI machine, and pyenv lives there), it is opened
    for traversal only (o+x, not listing) for the session, and restored after."""
    if os.geteuid() != 0:
        pytest.skip("acts as other users: needs root (CI runs as root)")
    changed = _open_for_traversal([sys.executable, sys.base_prefix, sys.prefix, str(TESTS)])
    try:
        yield
    finally:
        for directory, mode in reversed(changed):
            os.chmod(directory, mode)


@pytest.fixture
def users(python_for_everyone):
    """Three local users, A, B and C: A and B in the socket group SOCKET_GID, C outside it. What
    they leave (processes, /tmp/nodecomm-<uid>) is removed afterwards."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="nodecomm-users-"))
    root.chmod(0o755)
    made = []
    for uid, groups in zip(USER_UIDS, ((SOCKET_GID,), (SOCKET_GID,), ()), strict=True):
        home = root / str(uid)
        home.mkdir(mode=0o700)
        os.chown(home, uid, uid)
        made.append(User(uid, home, groups))
    try:
        yield tuple(made)
    finally:
        for uid in USER_UIDS:
            subprocess.run(["pkill", "-KILL", "-U", str(uid)], check=False)
        wait_until(
            lambda: not _running_as(USER_UIDS), 30, lambda: f"the test users' processes gone ({_running_as(USER_UIDS)})"
        )
        for uid in USER_UIDS:
            shutil.rmtree(f"/tmp/nodecomm-{uid}", ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
