"""Where the daemon listens by default: the one rule both the daemon and the client follow."""

from __future__ import annotations

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


def grpc_target(socket: str) -> str:
    """A gRPC target for a socket path, or a target given as such (unix:..., ipv4:..., ipv6:...)."""
    if socket.startswith(("unix:", "unix-abstract:", "ipv4:", "ipv6:", "dns:")):
        return socket
    return f"unix:{socket}"
