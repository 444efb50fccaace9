"""Where a daemon listens: the rules both the daemon and the client follow."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def default_socket_path() -> str:
    """$NODECOMM_SOCKET, else /run/nodecomm/nodecomm.sock as root, else under $XDG_RUNTIME_DIR."""
    configured = os.environ.get("NODECOMM_SOCKET")
    if configured:
        return configured
    if os.geteuid() == 0:
        return "/run/nodecomm/nodecomm.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/nodecomm-{os.geteuid()}"
    return str(Path(runtime) / "nodecomm" / "nodecomm.sock")


def descriptor_socket_path(socket: str) -> str:
    """Where the daemon listening at `socket` hands out file descriptors: beside it, at
    `<socket>.fd`. The daemon has no other choice, so a client finds it beside the socket it
    dialled, wherever that directory is mounted, before it joins (its identity comes from there)."""
    return socket + ".fd"


def lease_socket_path(socket: str) -> str:
    """Where the private daemon listening at `socket` holds its job's lease: beside it, at
    `<socket>.lease` (service/job_lease.py); a rank that started or found it connects there."""
    return socket + ".lease"


# The gRPC target schemes that name a TCP address rather than a Unix socket.
TCP_SCHEMES = ("ipv4:", "ipv6:", "dns:")


def grpc_target(socket: str) -> str:
    """A gRPC target for a socket path, or a target given as such (unix:..., ipv4:..., ipv6:...)."""
    if socket.startswith(("unix:", "unix-abstract:", *TCP_SCHEMES)):
        return socket
    return f"unix:{socket}"


# A job's private daemon keeps everything in one directory of its own: its sockets, the lock file
# its ranks and it decide under (client/daemon_choice.py, service/job_lease.py), and its log.
PRIVATE_LOCK_NAME = "lock"
PRIVATE_LOG_NAME = "daemon.log"
ADOPTION_KEY_NAME = "adoption.key"  # service/groups/adoption.py: the key the next daemon adopts groups with


def job_digest(job: str) -> str:
    """The name of the job's directory: a hash of its name."""
    return hashlib.sha256(job.encode()).hexdigest()[:16]


def private_socket_path(job: str) -> str:
    """Where the private daemon of the job named `job` listens, for this user on this machine:
    $XDG_RUNTIME_DIR (else /tmp/nodecomm-<uid>) /nodecomm-jobs/<job_digest(job)>/nodecomm.sock."""
    digest = job_digest(job)
    runtimes = [r for r in (os.environ.get("XDG_RUNTIME_DIR"), f"/tmp/nodecomm-{os.geteuid()}") if r]
    paths = [str(Path(r) / "nodecomm-jobs" / digest / "nodecomm.sock") for r in runtimes]
    # A runtime directory too deep for a Unix socket's path gives way to the short one.
    return next((p for p in paths if len(lease_socket_path(p)) < UNIX_PATH_MAX), paths[-1])


# sockaddr_un's sun_path holds 108 bytes, the terminating NUL among them.
UNIX_PATH_MAX = 108
