"""nodecomm: a per-node communication sidecar for multi-GPU inference engines.

import nodecomm
with nodecomm.connect(group="tp0", rank=r, world_size=n) as comm:
    y = comm.all_reduce(x)
"""

from nodecomm.byte_size import parse_byte_size
from nodecomm.errors import (
    DaemonUnavailableError,
    DeadlineExceededError,
    GroupMismatchError,
    InvalidArgumentError,
    NodecommError,
    PeerLostError,
    UnsupportedError,
)

__all__ = [
    "Communicator",
    "DaemonUnavailableError",
    "DeadlineExceededError",
    "GroupMismatchError",
    "HierarchicalCommunicator",
    "InvalidArgumentError",
    "NodecommError",
    "PeerLostError",
    "UnsupportedError",
    "connect",
    "connect_across_nodes",
    "parse_byte_size",
    "row_topk",
]


def __getattr__(name: str):
    # The client needs torch; the daemon imports this package without it.
    if name in ("connect", "Communicator", "connect_across_nodes", "HierarchicalCommunicator"):
        from nodecomm import client

        return getattr(client, name)
    if name == "row_topk":
        from nodecomm.topk_rows import row_topk

        return row_topk
    raise AttributeError(f"module 'nodecomm' has no attribute {name!r}")
