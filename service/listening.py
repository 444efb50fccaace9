"""Where the daemon listens: its Unix sockets' directory, modes and group, and TLS for TCP."""

from __future__ import annotations

import os
import socket

import grpc

from .config import DaemonConfig, parse_ids


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
    """Create the socket's directory (0750, the socket group's); remove a stale socket, but never
    take over a live one."""
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o750, exist_ok=True)
        restrict_socket_file(directory, 0o750, group)
    if not os.path.exists(path):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: left behind by a daemon that died
            return
    raise OSError(f"{path}: another process is serving on this socket; stop it or pick another --socket")
