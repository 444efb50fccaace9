"""JobLease: how a job's private daemon knows that its job is still there.

Every process of the job that uses the daemon keeps one connection to `<socket>.lease` open for as
long as it does; the kernel closes it when the process ends, SIGKILL included. Once none has been
open for the grace period the daemon stops. It decides under the lock file of the job's
directory, which a rank holds while it looks for the daemon, starts one and takes its lease
(client/daemon_choice.py): so no rank attaches to a daemon that is leaving, and no two ranks
start two. On the way out the daemon removes the lock file, its state and cache directories
where they are in the job's directory, and the directory, still holding the lock; a rank that
was waiting on it sees the file gone and starts over. It removes only names in the very
directory it started in (held open, compared by inode), never through a link.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import Callable, Iterable

from nodecomm.service.groups.adoption import KEY_FILE
from nodecomm.socket_path import PRIVATE_LOCK_NAME, PRIVATE_LOG_NAME, lease_socket_path

log = logging.getLogger("nodecomm.server")


class JobLease:
    def __init__(self, socket_path: str, grace_seconds: float, on_idle: Callable[[], None], kept: Iterable[str] = ()):
        self.path = lease_socket_path(socket_path)
        self.directory = os.path.dirname(socket_path) or "."
        # Of the directories the daemon keeps things in (its state and cache), those its job put in
        # the job's directory (the bench does): they go with it.
        here = os.path.abspath(self.directory)
        self._kept_here = sorted(
            {os.path.basename(d) for d in kept if d and os.path.dirname(os.path.abspath(d)) == here}
        )
        self.lock_path = os.path.join(self.directory, PRIVATE_LOCK_NAME)
        self._grace = grace_seconds
        self._on_idle = on_idle
        self._holders = 0
        self._timer: asyncio.TimerHandle | None = None
        self._server: asyncio.AbstractServer | None = None
        self._lock: int | None = None  # the lock file, held from the decision to leave to the end
        self._directory: int | None = None  # the job's directory, held open from the start

    async def start(self) -> None:
        self._directory = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # left by a daemon that was killed; the lock keeps out a live one
        self._server = await asyncio.start_unix_server(self._hold, path=self.path)
        os.chmod(self.path, 0o600)
        self._arm()  # a starter that died before taking its lease leaves nobody to wait for

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._holders += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            while await reader.read(4096):
                pass  # holders send nothing; anything sent is ignored
        except (OSError, asyncio.CancelledError):
            # Cancelled: the daemon is stopping with holders still there. Ended here, since
            # asyncio's stream callback (Python 3.11) logs a cancelled handler as an error.
            pass
        finally:
            writer.close()
            self._holders -= 1
            if self._holders == 0:
                self._arm()

    def _arm(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self._grace, lambda: asyncio.ensure_future(self._leave()))

    async def _leave(self) -> None:
        self._timer = None
        try:
            descriptor = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            # The job's directory is gone (a cleaned-up runtime directory), or its lock file is no
            # file of ours (a link): no rank finds this daemon any more, since attaching goes
            # through the lock file there.
            self._server.close()
            log.info("the job's directory is gone: stopping", extra={"directory": self.directory})
            self._on_idle()
            return
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(0.01)  # a rank is attaching; look again once it has
        if self._holders:
            fcntl.flock(descriptor, fcntl.LOCK_UN)
            os.close(descriptor)
            return
        self._lock = descriptor
        self._server.close()
        log.info("no process of the job holds the lease any more: stopping", extra={"lease": self.path})
        self._on_idle()

    def close(self) -> None:
        """After the daemon's other sockets are gone: the lease socket, the lock file and the job's
        directory (emptied of what the daemon put there), then the lock itself."""
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if self._lock is None:
            return  # stopped by a signal, not for want of holders: ranks may still come
        if self._same_directory():
            for name in (PRIVATE_LOG_NAME, PRIVATE_LOCK_NAME, KEY_FILE):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=self._directory)
            for name in self._kept_here:  # through the held directory; rmtree refuses a link
                with contextlib.suppress(OSError):
                    shutil.rmtree(f"/proc/self/fd/{self._directory}/{name}")
            with contextlib.suppress(OSError):
                os.rmdir(self.directory)  # only if nothing else was put there
        os.close(self._lock)
        self._lock = None

    def _same_directory(self) -> bool:
        """Whether the job's directory path still names the directory the daemon started in."""
        try:
            now = os.stat(self.directory, follow_symlinks=False)
        except OSError:
            return False
        held = os.fstat(self._directory)
        return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
