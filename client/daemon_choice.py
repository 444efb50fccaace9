"""Which daemon a rank talks to: the node's, or one private to its job that the job's ranks start.

    daemon="node"     the node daemon ($NODECOMM_SOCKET or the default path), as operators deploy it
    daemon="private"  the job's own daemon: the first of the job's ranks on this node to claim it
                      starts it, the others wait for it to serve; it exits once the last of them
                      is gone (they each hold its lease socket open; see service/job_lease.py)
    daemon="auto"     the node daemon if it answers, else the job's own

A private daemon lives in a directory of its own, 0700, under the user's runtime directory
($XDG_RUNTIME_DIR, else /tmp/nodecomm-<uid>): <runtime>/nodecomm-jobs/<hash of the job's key>/
holds its sockets (nodecomm.sock, .fd, .lease), the lock file its ranks and it decide under, and
its log. Every directory on the way is made 0700 or checked to be the user's own, writable by no
one else and no link (nodecomm.trust): one that another user made first is refused, by name, and
so is a daemon that does not run as the user. It reads the node's calibrations (the node daemon's
state directory, where there is one) and writes nothing; its metrics are off unless
NODECOMM_METRICS_ADDRESS asks for them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket as socketlib
import stat
import threading
import time
from dataclasses import dataclass
from enum import Enum

from nodecomm import trust
from nodecomm.errors import DaemonUnavailableError, DeadlineExceededError, InvalidArgumentError, NodecommError
from nodecomm.socket_path import (
    ADOPTION_KEY_NAME,
    PRIVATE_LOCK_NAME,
    PRIVATE_LOG_NAME,
    default_socket_path,
    lease_socket_path,
    private_socket_path,
)

from .daemon_process import answers, start_daemon

log = logging.getLogger("nodecomm.client")


class DaemonMode(str, Enum):
    """Which daemon a rank asks for (AUTO) or got (NODE, PRIVATE)."""

    AUTO = "auto"
    NODE = "node"
    PRIVATE = "private"

    def __str__(self) -> str:
        return self.value


MODES = tuple(mode.value for mode in DaemonMode)
ENVIRONMENT_VARIABLE = "NODECOMM_DAEMON"
ENVIRONMENT_SOCKET = "NODECOMM_SOCKET"
NODE_STATE_DIR = "/var/lib/nodecomm"  # the node daemon's, where it runs as root


@dataclass(frozen=True)
class DaemonChoice:
    """The daemon a rank uses: kind NODE or PRIVATE, its socket, and whether this process
    started it."""

    kind: DaemonMode
    socket: str
    started_here: bool = False

    @property
    def daemon_uids(self) -> frozenset[int]:
        """Who the daemon may run as (nodecomm.trust): the caller for a private one."""
        if self.kind is DaemonMode.PRIVATE:
            return trust.private_daemon_uids()
        return trust.node_daemon_uids(self.socket)

    def __str__(self) -> str:
        if self.kind is DaemonMode.NODE:
            return f"the node daemon at {self.socket}"
        return f"a private daemon at {self.socket}" + (" (started by this process)" if self.started_here else "")


def resolve_mode(mode: str | None, default: DaemonMode, where: dict) -> DaemonMode:
    """`mode`, else $NODECOMM_DAEMON, else `default`."""
    chosen = mode if mode is not None else os.environ.get(ENVIRONMENT_VARIABLE) or default
    if chosen not in MODES:
        source = "daemon" if mode is not None else ENVIRONMENT_VARIABLE
        raise InvalidArgumentError(f"{source} {chosen!r}: expected one of {', '.join(MODES)}", **where)
    return DaemonMode(chosen)


def decide(mode: DaemonMode, socket: str | None, job: str) -> tuple[DaemonMode, str]:
    """The kind (NODE or PRIVATE) and socket of the daemon `mode` picks, attaching to none."""
    node = socket or default_socket_path()
    auto = mode is DaemonMode.AUTO
    if mode is DaemonMode.NODE or (auto and answers(node, daemon_uids=trust.node_daemon_uids(node))):
        return DaemonMode.NODE, node
    named = "socket" if socket else ENVIRONMENT_SOCKET if os.environ.get(ENVIRONMENT_SOCKET) else ""
    if auto and named and node not in _warned:
        # An explicit socket meant a daemon there: say once that this job runs without it.
        _warned.add(node)
        log.warning(
            f"{named} {node} names a node daemon, but none answers there: this job uses a daemon private to it "
            f"(start nodecommd there, or set {ENVIRONMENT_VARIABLE}=node to fail instead)"
        )
    return DaemonMode.PRIVATE, socket if mode is DaemonMode.PRIVATE and socket else private_socket_path(job)


_warned: set[str] = set()  # the explicit sockets already warned about, once per process


def choose(
    mode: DaemonMode, socket: str | None, job: str, timeout: float, where: dict
) -> tuple[DaemonChoice, JobLeaseHandle | None]:
    """The daemon to use, and for a private one the lease this process now holds on it."""
    kind, path = decide(mode, socket, job)
    if kind is DaemonMode.NODE:
        return DaemonChoice(DaemonMode.NODE, path), None
    return attach_private(path, timeout, where)


def attach_private(socket: str, timeout: float, where: dict) -> tuple[DaemonChoice, JobLeaseHandle]:
    """Take a lease on the private daemon at `socket`, starting it first if none serves there."""
    deadline = time.monotonic() + timeout
    job = os.path.dirname(os.path.abspath(socket))
    sweep_abandoned_jobs(os.path.dirname(job), where, keep=job)
    try:
        lock, directory = _lock_job_directory(socket, deadline, where)
    except NodecommError as error:
        raise error.located(**where) from None
    socket = os.path.join(directory, os.path.basename(socket))
    try:
        started = False
        if not answers(socket, daemon_uids=trust.private_daemon_uids()):
            try:
                _start_private_daemon(socket, deadline, where)
            except DaemonUnavailableError:
                _remove_job_directory(directory)  # its log's end is in the error; nothing of it stays
                raise
            started = True
        lease = JobLeaseHandle.take(lease_socket_path(socket), where)
    finally:
        os.close(lock)  # and with it the lock
    choice = DaemonChoice(DaemonMode.PRIVATE, socket, started)
    log.info(f"using {choice}", extra={**where, "socket": socket})
    return choice, lease


# A job directory whose daemon is gone is left alone this long after its last write: the job's
# ranks, where they live on, start the next daemon there within a second (and it needs the
# adoption key left there); past this, nothing of the job is left to come back.
ABANDONED_AFTER_SECONDS = 60.0


def sweep_abandoned_jobs(jobs: str, where: dict, now: float | None = None, keep: str = "") -> list[str]:
    """Remove the job directories under `jobs` (a runtime directory's nodecomm-jobs) that a private
    daemon killed with SIGKILL left (its sockets, lock file, log and key), but `keep` (the
    caller's own job: its ranks may be about to start the next daemon there, which needs the key):
    no process holds the lock, nothing answers on its sockets, and nothing was written there for
    ABANDONED_AFTER_SECONDS, looked at again once the lock is held. Returns what it removed."""
    if os.path.basename(os.path.normpath(jobs)) != "nodecomm-jobs":
        return []  # a socket given by hand, anywhere: not a directory of jobs this sweeps
    now = time.time() if now is None else now
    removed = []
    try:
        names = os.listdir(jobs)
    except OSError:
        return removed
    for name in names:
        directory = os.path.join(jobs, name)
        if os.path.abspath(directory) == os.path.abspath(keep) or not _abandoned(directory, now):
            continue
        try:
            handle = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            lock = os.open(PRIVATE_LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=handle)
        except OSError:
            os.close(handle)
            continue  # no lock file: not a job directory
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a rank or a daemon deciding: not abandoned
            same = os.stat(PRIVATE_LOCK_NAME, dir_fd=handle, follow_symlinks=False).st_ino == os.fstat(lock).st_ino
            if not same or not _abandoned(directory, now):  # a rank came between the look and the lock
                continue
            for entry in os.scandir(handle):
                kind = os.stat(entry.name, dir_fd=handle, follow_symlinks=False).st_mode
                if stat.S_ISSOCK(kind) or entry.name in (PRIVATE_LOG_NAME, PRIVATE_LOCK_NAME, ADOPTION_KEY_NAME):
                    os.unlink(entry.name, dir_fd=handle)
            os.rmdir(directory)  # only where nothing else was put there
            removed.append(directory)
        except OSError:
            pass
        finally:
            os.close(lock)
            os.close(handle)
    if removed:
        log.info("removed the directories of jobs whose private daemon was killed", extra={**where, "removed": removed})
    return removed


def _abandoned(directory: str, now: float) -> bool:
    """Nothing written in `directory` for ABANDONED_AFTER_SECONDS and nothing listening there."""
    try:
        if os.path.islink(directory) or not os.path.isdir(directory):
            return False
        newest = max(os.lstat(os.path.join(directory, n)).st_mtime for n in [*os.listdir(directory), "."])
    except OSError:
        return False
    return now - newest >= ABANDONED_AFTER_SECONDS and _nobody_at(os.path.join(directory, "nodecomm.sock"))


def _nobody_at(socket: str) -> bool:
    """Whether no daemon listens at `socket` or its lease socket (refused, or no socket file)."""
    for path in (socket, lease_socket_path(socket)):
        probe = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
            return False
        except (ConnectionRefusedError, FileNotFoundError):
            continue
        except OSError:
            return False  # anything else: leave it be
        finally:
            probe.close()
    return True


def _remove_job_directory(directory: str) -> None:
    """What a start that failed left in the job's directory (its log, the lock file, still held),
    and the directory itself where nothing else is in it, as a daemon that leaves does."""
    for name in (PRIVATE_LOG_NAME, PRIVATE_LOCK_NAME):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
    with contextlib.suppress(OSError):
        os.rmdir(directory)


def _lock_job_directory(socket: str, deadline: float, where: dict) -> tuple[int, str]:
    """The job directory's lock file, locked, and the directory's real path; both made if missing,
    and with them what is missing above (each 0700, each checked: nodecomm.trust). A daemon that
    leaves removes the file while holding the lock: a lock taken on a removed file is dropped and
    taken again."""
    while True:
        directory = _make_job_directory(os.path.dirname(os.path.abspath(socket)))
        path = os.path.join(directory, PRIVATE_LOCK_NAME)
        try:
            descriptor = trust.open_private_file(path)
        except FileNotFoundError:
            continue  # the directory went with a leaving daemon
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(descriptor)
                    raise DeadlineExceededError(
                        f"another process held {path} past the timeout (starting the job's private daemon?)",
                        **where,
                    ) from None
                time.sleep(0.02)
        try:
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(descriptor).st_ino:
                return descriptor, directory
        except FileNotFoundError:
            pass
        os.close(descriptor)


def _make_job_directory(directory: str) -> str:
    """`directory` made, with every missing directory above it, each 0700 and checked to be this
    user's own (an existing one too); its real path."""
    missing = []
    probe = directory
    while not os.path.lexists(probe) and probe != os.path.dirname(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    for path in reversed(missing[1:]):
        trust.make_private_directory(path)
    return trust.make_private_directory(directory)


def _start_private_daemon(socket: str, deadline: float, where: dict) -> None:
    directory = os.path.dirname(socket)
    flags = ["--private", "true"]
    if "NODECOMM_METRICS_ADDRESS" not in os.environ:
        flags += ["--metrics-address", "off"]
    if "NODECOMM_STATE_DIR" not in os.environ and os.access(NODE_STATE_DIR, os.R_OK | os.X_OK):
        flags += ["--state-dir", NODE_STATE_DIR]
    environment = dict(os.environ)
    environment.pop("CUDA_VISIBLE_DEVICES", None)  # it must see every GPU of the job's ranks
    # A session of its own: a signal to the rank's process group does not reach it; it ends when
    # its job's leases do.
    start_daemon(
        socket,
        *flags,
        log_path=os.path.join(directory, PRIVATE_LOG_NAME),
        env=environment,
        own_session=True,
        timeout=max(0.0, deadline - time.monotonic()),
        where=where,
        daemon_uids=trust.private_daemon_uids(),
    )


class JobLeaseHandle:
    """This process's hold on a private daemon's lease socket. One connection per socket however
    many holders the process has; closed when the last lets go (or when the process ends)."""

    _connections: dict[str, tuple[socketlib.socket, int]] = {}
    _guard = threading.Lock()

    def __init__(self, path: str):
        self.path = path
        self._released = False

    @classmethod
    def take(cls, path: str, where: dict) -> JobLeaseHandle:
        with cls._guard:
            held = cls._connections.get(path)
            if held is not None and _closed_by_peer(held[0]):
                # The daemon it was held on is gone (killed): this process holds the next one's.
                held[0].close()
                held = (None, held[1])
            if held is None or held[0] is None:
                try:
                    connection = trust.connect_checked(path, trust.private_daemon_uids(), 5.0)
                except NodecommError as error:
                    raise error.located(**where) from None
                except OSError as error:
                    raise DaemonUnavailableError(f"could not take the lease at {path}: {error}", **where) from None
                connection.settimeout(None)
                held = (connection, held[1] if held is not None else 0)
            cls._connections[path] = (held[0], held[1] + 1)
        return cls(path)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        with self._guard:
            connection, holders = self._connections[self.path]
            if holders > 1:
                self._connections[self.path] = (connection, holders - 1)
                return
            del self._connections[self.path]
        with contextlib.suppress(OSError):
            connection.close()


def _closed_by_peer(connection: socketlib.socket) -> bool:
    """Whether the daemon at the other end of a lease connection has gone (it never sends)."""
    try:
        return connection.recv(1, socketlib.MSG_PEEK | socketlib.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
