"""Where the daemon listens: its Unix sockets' directory, modes and group, and TLS for TCP."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import tempfile
from collections.abc import Iterable

import grpc

from nodecomm.service.config import DaemonConfig
from nodecomm.service.config_checks import parse_ids
from nodecomm.socket_path import UNIX_PATH_MAX
from nodecomm.trust import resolve_directory, who


def restrict_socket_file(path: str, mode: int, group: str) -> None:
    """Give `path` its mode and, when configured, the socket group (which must exist and be ours
    to give: root, or a group the daemon's user belongs to)."""
    os.chmod(path, mode)
    if group:
        (gid,) = parse_ids("socket_group", group)
        try:
            os.chown(path, -1, gid)
        except PermissionError:
            raise OSError(
                f"socket_group {group!r}: cannot give {path} to gid {gid}; run as root or as a member"
            ) from None


def tls_credentials(config: DaemonConfig) -> grpc.ServerCredentials:
    def read(path: str) -> bytes:
        with open(path, "rb") as handle:
            return handle.read()

    client_ca = read(config.tls_client_ca) if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(read(config.tls_key), read(config.tls_cert))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def prepare_socket_path(path: str, group: str = "") -> None:
    """Make the socket's directory if it is missing (0750, the socket group's; what is missing
    above it 0700), refuse one this daemon's clients could not trust (nodecomm.trust: this uid's
    or root's, writable by no one else), and remove a stale socket of this uid: never a live one,
    another uid's, or anything but a socket."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(directory):
        os.makedirs(os.path.dirname(directory), mode=0o700, exist_ok=True)
        os.mkdir(directory, 0o750)
        restrict_socket_file(directory, 0o750, group)
    resolve_directory(directory, frozenset({os.geteuid()}))
    if not os.path.lexists(path):
        return
    info = os.lstat(path)
    if not stat.S_ISSOCK(info.st_mode):
        raise OSError(f"{path} is not a socket; refusing to remove it: remove it yourself or pick another --socket")
    if info.st_uid != os.geteuid():
        raise OSError(f"{path} belongs to {who(info.st_uid)}; refusing to remove it: pick another --socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: left behind by a daemon that died
            return
    raise OSError(f"{path}: another process is serving on this socket; stop it or pick another --socket")


def listen_unix(path: str, group: str) -> socket.socket:
    """A listening Unix socket at `path` (prepared by prepare_socket_path), 0660 in `group`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        restrict_socket_file(path, 0o660, group)
        # The kernel's most: a burst of connections queues instead of being turned away.
        sock.listen(socket.SOMAXCONN)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


_INTERNAL_PREFIX = "nodecommd-"


def internal_socket(socket_path: str, suffix: str) -> str:
    """Where gRPC listens for the gate (service/access/connections.py): beside `socket_path` as
    <socket_path>.<suffix>, or, where that would be too long for a Unix socket, in a 0700
    directory of this daemon's own under the temporary directory."""
    path = f"{socket_path}.{suffix}"
    if len(path.encode()) < UNIX_PATH_MAX:
        return path
    return os.path.join(tempfile.mkdtemp(prefix=_INTERNAL_PREFIX), suffix)


def remove_internal_directories(paths: Iterable[str]) -> None:
    """The directories internal_socket made, once their sockets are gone."""
    for path in set(paths):
        if os.path.basename(os.path.dirname(path)).startswith(_INTERNAL_PREFIX):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(path))
