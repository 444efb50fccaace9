"""Whether a peer's process is still there, without a daemon: each rank holds a lock on one byte
of its group's control page, which the kernel drops when the process ends (SIGKILL included).

A wait for a peer that runs out is DeadlineExceededError while the peer lives (it is slow or
stopped) and PeerLostError once it is gone: what the daemon would have said from the peer's
session, which a group that outlived its daemon does not have. The locks are open-file-description
locks (F_OFD_SETLK) on a descriptor this rank opened itself, so that no other rank's descriptor
of the page (they share the daemon's open file description) holds or drops them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import struct

# struct flock on Linux x86_64 and aarch64: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks).
_FLOCK = "hhqqi4x"


class PeerLiveness:
    def __init__(self, control_fd: int, rank: int):
        self._fd = os.open(f"/proc/self/fd/{control_fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, rank, 1, 0))
        except BaseException:
            os.close(self._fd)
            raise

    @classmethod
    def held(cls, control_fd: int, rank: int) -> PeerLiveness | None:
        """This rank's lock, or None where the page cannot be reopened (no /proc) or locked."""
        try:
            return cls(control_fd, rank)
        except OSError:
            return None

    def gone(self, rank: int) -> bool:
        """Whether `rank`'s process has ended (its lock is free)."""
        asked = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, rank, 1, 0)
        try:
            answer = fcntl.fcntl(self._fd, fcntl.F_OFD_GETLK, asked)
        except OSError:
            return False
        return struct.unpack(_FLOCK, answer)[0] == fcntl.F_UNLCK

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


# Before a group forms there is no control page to lock: a rank that knows its peers' processes
# (the torch backend learns them through its store) watches them by pid and start time instead.
ProcessId = tuple[int, int]  # pid, start time (clock ticks after boot, /proc/<pid>/stat's 22nd field)


def this_machine() -> str:
    """This machine's boot, which every process on it shares (containers too) and no other
    machine does; the host name where the kernel does not say. Pids compare only within one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return boot.read().strip()
    except OSError:
        return platform.node()


def pid_namespace() -> str:
    """This process's pid namespace ("" where /proc does not say): pids compare only within one
    (ranks in two containers of one machine share its boot, not their pids)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def this_process() -> ProcessId | None:
    """This process as process_running() knows it again (None without /proc)."""
    return _process(os.getpid())


def process_running(process: ProcessId) -> bool:
    """Whether the process is still there (its pid not reused by another since: same start time;
    a zombie, ended but not yet reaped by its launcher, is not)."""
    return _process(process[0], running=True) == tuple(process)


def _process(pid: int, running: bool = False) -> ProcessId | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # the command name may hold spaces
    except OSError:
        return None
    if running and fields[0] in (b"Z", b"X"):  # field 3, the state: zombie or dead
        return None
    return pid, int(fields[19])  # after ") ": field 3 is fields[0]; starttime is field 22
