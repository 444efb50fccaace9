"""How an engine's ranks join one nodecomm group over the engine's own CPU (gloo) process group:
the custom all-reduce slot's group (custom_all_reduce.py) and the DCP top-k merge's
(vllm_dcp_topk.py) alike.

Every rank learns rank 0's token (a fresh group name per engine object) and group key (which
admits this engine's ranks, and no other process, to the group) and every rank's node and GPU,
over the CPU group; then each joins, and the ranks agree over the CPU group whether all did: where
one rank cannot, none uses the group, since ranks that answer differently would wait for each other
forever. Joining never raises into the engine: the reason goes back instead.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nodecomm.client import peer_liveness
from nodecomm.errors import NodecommError

log = logging.getLogger("nodecomm.integrations")


@dataclass
class EngineGroup:
    """What joining gave: the communicator (None where the ranks could not all join), why not,
    and every rank's GPU UUID ("" for the CPU or where it cannot be read)."""

    comm: object | None
    disabled_reason: str = ""
    gpu_uuids: list[str] = field(default_factory=list)


def join(
    group: dist.ProcessGroup,
    device: torch.device,
    prefix: str,
    usable: Callable[[object], str] = lambda comm: "",
    **connect: object,
) -> EngineGroup:
    """Every rank of `group` joins the nodecomm group named `prefix`.<rank 0's token> on `device`
    (collective over `group`); `connect` goes to nodecomm.connect, and `usable(comm)` gives the
    reason a joined group is of no use here ("" where it is)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    comm, reason, uuids = None, "", []
    try:
        mine = (node_identity(), secrets.token_hex(6), secrets.token_hex(16), _gpu_uuid(device))
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, mine, group=group)
        uuids = [uuid for *_, uuid in everyone]
        nodes = {node for node, *_ in everyone}
        if len(nodes) > 1:
            reason = f"the group spans {len(nodes)} nodes; nodecomm reduces within one"
        else:
            _, token, group_key, _ = everyone[0]
            import nodecomm

            where = "cpu" if device.type == "cpu" else f"cuda:{device.index}"
            comm = nodecomm.connect(f"{prefix}.{token}", rank, world_size, device=where, group_key=group_key, **connect)
            reason = usable(comm)
    except NodecommError as error:
        reason = str(error)
    except Exception as error:  # noqa: BLE001 (whatever failed, the engine runs on without us)
        reason = f"{type(error).__name__}: {error}"
    try:
        everyone = [None] * world_size
        dist.all_gather_object(everyone, 0 if reason else 1, group=group)
        agreed = min(everyone)
    except Exception as error:  # noqa: BLE001
        reason, agreed = reason or f"the ranks could not agree over the CPU group: {error}", 0
    if agreed:
        return EngineGroup(comm, "", uuids)
    if comm is not None:
        comm.close()
    return EngineGroup(None, reason or "another rank of the group cannot use nodecomm", uuids)


node_identity = peer_liveness.this_machine  # what the ranks compare before they join


def _gpu_uuid(device: torch.device) -> str:
    """The UUID of `device`'s GPU, the same in every process whatever it sees; "" for the CPU or
    where it cannot be read. Never raises: every rank must reach the collective it is sent in."""
    if device.type != "cuda":
        return ""
    from nodecomm import _native

    try:
        return _native.cuda_devices()[device.index]["uuid"]
    except Exception:  # noqa: BLE001 (unknown: fully_connected stays False)
        return ""


def nvlink_between(uuids: list[str]) -> bool:
    """Whether every pair of these GPUs has peer access with native atomics (NVLink), as far as
    this process sees them; False where it does not see them all, or for the CPU."""
    if not all(uuids) or len(set(uuids)) < len(uuids):
        return False
    from nodecomm import _native

    visible = [device["uuid"] for device in _native.cuda_devices()]
    if not set(uuids) <= set(visible):
        return False
    links, index = _native.cuda_peer_links(), [visible.index(uuid) for uuid in uuids]
    return all(all(links[i][j][:2]) for i in index for j in index if i != j)
