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
