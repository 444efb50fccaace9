"""nodecommd as a child process: its command line, whether it serves, and a start that waits for it.

The job's private daemon (daemon_choice.py), the bench's own daemon and the tests' daemons all
start this way, so a daemon that exits early or never serves fails the same way everywhere:
DaemonUnavailableError with the end of its log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nodecomm.daemon_channel import open_channel
from nodecomm.errors import DaemonUnavailableError
from nodecomm.socket_path import grpc_target


def daemon_command(socket: str, *flags: str) -> list[str]:
    """The command line that runs nodecommd on `socket` with `flags` in this Python."""
    return [sys.executable, "-m", "nodecomm.service", "--socket", socket, *flags]


def answers(socket: str, timeout: float = 1.0, daemon_uids: frozenset[int] | None = None) -> bool:
    """Whether a daemon serves on `socket` (its health service says SERVING). With `daemon_uids`,
    only one that proves who it is (nodecomm.daemon_channel) counts, and one that fails the
    checks raises PermissionDeniedError."""
    target = grpc_target(socket)
    if target.startswith("unix:") and not os.path.exists(target.removeprefix("unix:")):
        return False
    if daemon_uids is None:
        channel = grpc.insecure_channel(target)
    else:
        try:
            channel, _ = open_channel(target, daemon_uids, timeout)
        except (DaemonUnavailableError, OSError):  # gone, stale, or not ours to open
            return False
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def start_daemon(
    socket: str,
    *flags: str,
    log_path: str | None = None,
    env: Mapping[str, str] | None = None,
    own_session: bool = False,
    timeout: float = 30.0,
    where: Mapping[str, object] | None = None,
    daemon_uids: frozenset[int] | None = None,
) -> subprocess.Popen:
    """Start nodecommd on `socket` and return once it serves. Its output goes to `log_path`
    (appended; else this process's), its environment is `env` (else this one's); `own_session`
    keeps signals to this process group from reaching it; `daemon_uids` are who the daemon that
    answers may run as (answers()). Raises DaemonUnavailableError, with the end of the log, when
    it exits first or does not serve within `timeout`; on that or any interruption (Ctrl-C) while
    it starts, it is killed and reaped first."""
    where = dict(where or {})
    command = daemon_command(socket, *flags)
    deadline = time.monotonic() + timeout
    process: subprocess.Popen | None = None
    try:
        with contextlib.ExitStack() as stack:
            output = None if log_path is None else stack.enter_context(open(log_path, "ab"))
            with interrupts_held():  # a daemon forked but not yet ours to kill would be lost
                process = subprocess.Popen(
                    command,
                    stdout=output,
                    stderr=None if output is None else subprocess.STDOUT,
                    env=env,
                    start_new_session=own_session,
                )
        while not answers(socket, timeout=0.5, daemon_uids=daemon_uids):
            if process.poll() is not None:
                raise DaemonUnavailableError(
                    f"nodecommd exited with {process.returncode} before serving on {socket}: {log_tail(log_path)}",
                    **where,
                )
            if time.monotonic() > deadline:
                raise DaemonUnavailableError(
                    f"nodecommd did not serve on {socket} within {timeout:.0f} s: {log_tail(log_path)}", **where
                )
            time.sleep(0.05)
    except BaseException:
        # Ctrl-C included: a daemon left starting (in a session of its own) would serve on with
        # nobody to stop it, and fill the directory its caller removes.
        if process is not None:
            process.kill()
            process.wait()
        raise
    return process


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C held back for the block and raised as KeyboardInterrupt at its end: for steps that
    must not be cut in two (a process started, and its handle kept). Only where Python raises
    KeyboardInterrupt for SIGINT (its default handler), and only on the main thread, which alone
    runs signal handlers; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def log_tail(path: str | None, limit: int = 1500) -> str:
    """The last `limit` bytes of a daemon's log, for an error message."""
    if path is None:
        return "(its output went to this process's)"
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - limit))
            return handle.read().decode(errors="replace").strip()
    except OSError:
        return "(no log)"
