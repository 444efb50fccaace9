"""Whom a process trusts with its tensors: the directories, sockets and daemons it checks before
it talks to a daemon, and the directories it makes for itself.

A rank hands a daemon read and write access to its data, so, as OpenSSH and systemd do for their
sockets, it talks only to a daemon it has checked:
- every directory on the way to the socket is owned by root or a trusted uid and writable by no
  one else, unless it is sticky, as /tmp is: there another user can neither rename nor remove
  what is not theirs; a symbolic link on the way is followed only where its owner is trusted,
  and the checked real path is what gets dialled;
- the socket file is a socket owned by a uid the daemon may run as, and so is the process that
  answers on it (SO_PEERCRED);
- on a loopback TCP address, every socket there is owned by such a uid (a daemon elsewhere
  proves itself with TLS instead: nodecomm.daemon_channel).
A job's private daemon must run as the caller. The node daemon may run as root, as the caller, as
NODECOMM_DAEMON_USER, or as the owner of its socket's directory in /run, which only root makes
(systemd's RuntimeDirectory= with User=).

The directories a process makes for itself (the runtime directory's fallback, a job's directory)
are made 0700 and checked after making: one that another user made first is refused, by name.
"""

from __future__ import annotations

import errno
import os
import pwd
import socket
import stat
import struct
from dataclasses import dataclass

from nodecomm import tcp_owners
from nodecomm.errors import DaemonUnavailableError, InvalidArgumentError, NoDaemonError, PermissionDeniedError
from nodecomm.socket_path import TCP_SCHEMES

DAEMON_USER_VARIABLE = "NODECOMM_DAEMON_USER"
_MAX_LINKS = 40  # as the kernel's ELOOP


def who(uid: int) -> str:
    """'uid 1001 (bob)', or 'uid 1001' for a uid without a name."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _you() -> str:
    return f"you ({who(os.geteuid())})"


def private_daemon_uids() -> frozenset[int]:
    """Who a job's private daemon may run as: the caller."""
    return frozenset({os.geteuid()})


def node_daemon_uids(socket_path: str | None = None) -> frozenset[int]:
    """Who the node daemon may run as: root, the caller, NODECOMM_DAEMON_USER (names or uids,
    comma-separated), and the owner of `socket_path`'s directory where that directory is in /run,
    whose entries only root makes (systemd's RuntimeDirectory= with User=)."""
    uids = {0, os.geteuid()}
    for item in (part.strip() for part in os.environ.get(DAEMON_USER_VARIABLE, "").split(",")):
        if not item:
            continue
        try:
            uids.add(int(item) if item.isdigit() else pwd.getpwnam(item).pw_uid)
        except KeyError:
            raise InvalidArgumentError(
                f"{DAEMON_USER_VARIABLE} names user {item!r}, which does not exist; expected user names or uids"
            ) from None
    if socket_path and not socket_path.startswith((*TCP_SCHEMES, "unix-abstract:")):
        directory = os.path.dirname(os.path.abspath(socket_path.removeprefix("unix:")))
        try:
            run, own = os.lstat("/run"), os.lstat(directory)
        except OSError:
            return frozenset(uids)
        if (
            os.path.dirname(directory) == "/run"
            and stat.S_ISDIR(run.st_mode)
            and run.st_uid == 0
            and not run.st_mode & 0o022
            and stat.S_ISDIR(own.st_mode)
        ):
            uids.add(own.st_uid)
    return frozenset(uids)


@dataclass(frozen=True)
class Stakes:
    """What whoever controls a directory that fails the checks could do, and what to do instead:
    the end of every refusal's message."""

    risk: str
    advice: str


_DAEMON_STAKES = Stakes(
    "put a daemon there that reads and changes your tensors",
    "Set XDG_RUNTIME_DIR (or NODECOMM_SOCKET) to a directory only you or root can write, for example "
    "`export XDG_RUNTIME_DIR=$(mktemp -d)` before starting every rank of the job.",
)
CALIBRATION_STAKES = Stakes(
    "put a calibration there that decides the path of every group's collectives",
    "Point state_dir (or XDG_STATE_HOME) at a directory only the daemon's user or root can write.",
)
ADOPTION_STAKES = Stakes(
    "read the adoption key there and act as any rank of a group the daemon formed",
    "Point state_dir (or XDG_STATE_HOME) at a directory only the daemon's user or root can write.",
)


def resolve_directory(path: str, trusted: frozenset[int], stakes: Stakes = _DAEMON_STAKES) -> str:
    """The real path of the directory `path`, checked from / down: every directory owned by root or
    a uid in `trusted`, none writable by group or others unless sticky, symbolic links followed
    only where their owner is root or in `trusted`. Raises PermissionDeniedError naming the first
    that fails and what `stakes` it would put at risk, FileNotFoundError where one is missing."""
    trusted = trusted | {0}
    _check_directory("/", os.lstat("/"), trusted, True, stakes)
    pending = os.path.abspath(path).split("/")[1:]
    current, links = "/", 0
    while pending:
        name = pending.pop(0)
        if not name:
            continue
        candidate = os.path.join(current, name)
        info = os.lstat(candidate)
        if stat.S_ISLNK(info.st_mode):
            if info.st_uid not in trusted:
                raise PermissionDeniedError(
                    f"{candidate} is a symbolic link of {who(info.st_uid)}, who could point it anywhere; "
                    f"expected links only of {_you()} or root on the way to {path}"
                )
            links += 1
            if links > _MAX_LINKS:
                raise PermissionDeniedError(f"{path}: more than {_MAX_LINKS} symbolic links on the way")
            target = os.path.normpath(os.path.join(current, os.readlink(candidate)))
            pending = target.split("/")[1:] + pending
            current = "/"
            continue
        if not stat.S_ISDIR(info.st_mode):
            raise PermissionDeniedError(f"{candidate} is not a directory (on the way to {path})")
        _check_directory(candidate, info, trusted, True, stakes)
        current = candidate
    return current


def _check_directory(
    path: str, info: os.stat_result, trusted: frozenset[int], sticky_allowed: bool, stakes: Stakes = _DAEMON_STAKES
) -> None:
    if info.st_uid not in trusted:
        raise PermissionDeniedError(
            f"{path} belongs to {who(info.st_uid)}, not to {_you()} or root: whoever owns it can {stakes.risk}. "
            f"{stakes.advice}"
        )
    writable = info.st_mode & 0o022
    if writable and not (sticky_allowed and info.st_mode & stat.S_ISVTX):
        raise PermissionDeniedError(
            f"{path} has mode {stat.S_IMODE(info.st_mode):04o}: other users can write to it and could {stakes.risk}; "
            f"expected a directory only its owner can write. {stakes.advice}"
        )


def check_socket(path: str, daemon_uids: frozenset[int]) -> str:
    """The real path of the daemon socket at `path` once its directories (see resolve_directory)
    and the socket file itself (a socket, owned by one of `daemon_uids`) pass."""
    directory = resolve_directory(os.path.dirname(os.path.abspath(path)), daemon_uids | {os.geteuid()})
    real = os.path.join(directory, os.path.basename(path))
    info = os.lstat(real)
    if not stat.S_ISSOCK(info.st_mode):
        raise PermissionDeniedError(f"{real} is not a socket; expected the daemon's Unix socket")
    if info.st_uid not in daemon_uids:
        raise PermissionDeniedError(
            f"{real} belongs to {who(info.st_uid)}; the daemon there must run as {_names(daemon_uids)}, so it is "
            f"not one {_you()} can trust with your tensors"
        )
    return real


def check_peer(connection: socket.socket, daemon_uids: frozenset[int], path: str) -> None:
    """Refuse the process at the other end of `connection` (to `path`) unless it runs as one of
    `daemon_uids` (SO_PEERCRED)."""
    pid, uid, _ = peer_credentials(connection)
    if uid not in daemon_uids:
        raise PermissionDeniedError(
            f"the process serving {path} (pid {pid}) runs as {who(uid)}; expected {_names(daemon_uids)}: another "
            f"user's daemon could read and change your tensors"
        )


def peer_credentials(connection: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def connect_checked(path: str, daemon_uids: frozenset[int], timeout: float) -> socket.socket:
    """A connection to the daemon socket at `path`, its path, file and peer checked."""
    return _connect_to(check_socket(path, daemon_uids), daemon_uids, timeout)


def _connect_to(real: str, daemon_uids: frozenset[int], timeout: float) -> socket.socket:
    """A connection to the checked socket at `real`, its peer checked."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(timeout)
        connection.connect(real)
        check_peer(connection, daemon_uids, real)
    except BaseException:
        connection.close()
        raise
    return connection


def checked_target(target: str, daemon_uids: frozenset[int], timeout: float = 5.0) -> str:
    """A gRPC target for the daemon at `target` (a socket path or unix:PATH), its socket checked
    and its process asked who it is first. NoDaemonError where nothing serves there.
    (TCP targets: nodecomm.daemon_channel.)"""
    if target.startswith("unix-abstract:"):
        raise InvalidArgumentError(
            f"socket {target!r}: an abstract socket has no owner or mode to check; expected a socket path"
        )
    path = target.removeprefix("unix:")
    try:
        real = check_socket(path, daemon_uids)
        _connect_to(real, daemon_uids, timeout).close()
    except (FileNotFoundError, ConnectionRefusedError) as error:
        raise NoDaemonError(f"daemon unavailable: nothing serves at {path} ({error.strerror})") from None
    return f"unix:{real}"


def check_loopback_listener(host: str, port: int, daemon_uids: frozenset[int]) -> None:
    """Refuse the loopback address `host`:`port` unless something listens there and every socket
    where a connection to it could land is owned by one of `daemon_uids` (/proc/net/tcp{,6}), as
    check_socket does for a Unix socket's file. DaemonUnavailableError where nothing listens."""
    owners, listening = tcp_owners.owners_at(host, port)
    strangers = sorted(owners - daemon_uids - {0})  # root: also what TIME_WAIT rows show
    if strangers:
        raise PermissionDeniedError(
            f"{host}:{port} is served by a socket of {_names(frozenset(strangers))}; the daemon there must run as "
            f"{_names(daemon_uids)}, so it is not one {_you()} can trust with your tensors"
        )
    if not listening:
        raise DaemonUnavailableError(f"daemon unavailable: nothing listens at {host}:{port}")


def make_private_directory(path: str) -> str:
    """`path` as a directory of this uid's that no one else can write, made 0700 if missing, and
    its real path: an existing one must be a directory (not a link) that this uid owns and that no
    one else can write. The directories above it are checked as resolve_directory does."""
    parent = resolve_directory(os.path.dirname(os.path.abspath(path)), frozenset({os.geteuid()}))
    real = os.path.join(parent, os.path.basename(path))
    try:
        os.mkdir(real, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(real)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise PermissionDeniedError(
            f"{real} is {'a symbolic link' if stat.S_ISLNK(info.st_mode) else 'not a directory'}; expected a "
            f"directory that {_you()} own. Remove it, or: {_DAEMON_STAKES.advice}"
        )
    if info.st_uid != os.geteuid():
        raise PermissionDeniedError(
            f"{real} belongs to {who(info.st_uid)}, not to {_you()}: another user made it first, and a daemon "
            f"found under it could read and change your tensors. Have it removed, or: {_DAEMON_STAKES.advice}"
        )
    _check_directory(real, info, frozenset({os.geteuid()}), sticky_allowed=False)
    return real


def trusted_directory(path: str, owners: frozenset[int], stakes: Stakes) -> str:
    """resolve_directory's real path of `path`, which itself no one else may write even if sticky:
    a directory whose files are trusted as they are."""
    directory = resolve_directory(path, owners, stakes)
    _check_directory(directory, os.lstat(directory), owners | {0}, False, stakes)
    return directory


def read_trusted_file(path: str, owners: frozenset[int], stakes: Stakes) -> str:
    """The text of the regular file `path`, read only where it and every directory on the way are
    owned by root or one of `owners` and writable by no one else (trusted_directory), reached
    through no link another user owns. PermissionDeniedError names what fails and what `stakes`
    it would put at risk; FileNotFoundError where the file or a directory is missing."""
    directory = trusted_directory(os.path.dirname(os.path.abspath(path)), owners, stakes)
    real = os.path.join(directory, os.path.basename(path))
    try:
        descriptor = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise PermissionDeniedError(f"{real} is a symbolic link; expected a regular file") from None
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise PermissionDeniedError(f"{real} is not a regular file")
        if info.st_uid not in owners | {0} or info.st_mode & 0o022:
            whose = f"belongs to {who(info.st_uid)}" if info.st_uid not in owners | {0} else "others can write it"
            raise PermissionDeniedError(f"{real} {whose}: whoever can write it can {stakes.risk}. {stakes.advice}")
        return handle.read().decode()


def open_private_file(path: str) -> int:
    """A descriptor of the regular file `path` (made 0600 if missing) that this uid owns, opened
    without following a link."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(descriptor)
        raise PermissionDeniedError(
            f"{path} is not a regular file that {_you()} own (it belongs to {who(info.st_uid)}); refusing to use it"
        )
    return descriptor


def _names(uids: frozenset[int]) -> str:
    return " or ".join(who(uid) for uid in sorted(uids))
