"""Opening a group's top-k exchanges: every rank's call for the group's n-th exchange, compared on
what they must agree on, then every owner's slab allocated once and a token for them handed to
each rank. Disagreeing ranks, a missing one or a caller that stops waiting fail every rank alike."""

from __future__ import annotations

import logging
import math
import secrets
from typing import TYPE_CHECKING

from nodecomm import _native
from nodecomm.capabilities import CAPABILITIES, DeviceKind
from nodecomm.errors import (
    DeadlineExceededError,
    GroupMismatchError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from nodecomm.service.access.quotas import Quotas
from nodecomm.service.config import DaemonConfig
from nodecomm.service.groups.rendezvous import OnStop, Rendezvous
from nodecomm.service.memory.allocator import allocate_cuda_topk_slabs, allocate_topk_slabs, max_blocks_for
from nodecomm.service.memory.handles import ClaimTable
from nodecomm.service.metrics.families import DaemonMetrics
from nodecomm.topk_layout import LAYOUT_VERSION, TopkLayout
from nodecomm.v1 import control_pb2 as pb

if TYPE_CHECKING:
    from nodecomm.service.groups.group import Group

log = logging.getLogger("nodecomm.groups")

DEFAULT_EXCHANGE_TIMEOUT_SECONDS = 60.0


def exchange_timeout(seconds: float) -> float:
    """How long a top-k exchange call waits for the other ranks: what it asks for when that is a
    positive, finite number of seconds, else (0, negative, NaN, infinite) the default."""
    return seconds if math.isfinite(seconds) and seconds > 0 else DEFAULT_EXCHANGE_TIMEOUT_SECONDS


# What every rank's call for an exchange must agree on.
AGREED = ("max_rows", "topk", "layout_version")


class TopkOpenings:
    """The daemon's side of TopkExchange opening, over the registry's claims and quotas."""

    def __init__(self, config: DaemonConfig, metrics: DaemonMetrics, claims: ClaimTable, quotas: Quotas):
        self.config = config
        self.metrics = metrics
        self.claims = claims
        self.quotas = quotas

    async def open(self, group: Group, request: pb.TopkExchangeRequest, devices: list[int]) -> pb.TopkExchangeReply:
        """Wait for every rank's call for the same exchange of `group` (an active one; on a CUDA
        group rank r runs on daemon GPU index devices[r]); if they agree, allocate every
        owner's slab and answer each rank with a token for them. Disagreeing ranks all get one error."""
        where = dict(group=request.group or None, rank=request.rank)
        world_size = group.args.world_size
        sizes = CAPABILITIES[group.args.device_kind].topk_world_sizes
        if world_size not in sizes:
            raise InvalidArgumentError(
                f"top-k exchanges support world sizes {sorted(sizes)}; this group has {world_size}", **where
            )
        if request.layout_version != LAYOUT_VERSION:
            raise InvalidArgumentError(
                f"layout_version {request.layout_version}: this daemon lays slabs out as version {LAYOUT_VERSION}",
                **where,
            )
        if request.max_rows < 1 or request.topk < 1:
            raise InvalidArgumentError(
                f"max_rows {request.max_rows} and topk {request.topk}: expected both at least 1", **where
            )
        if len(group.topk_slabs) >= self.config.max_topk_exchanges_per_group:
            raise ResourceExhaustedError(
                f"the group holds {len(group.topk_slabs)} top-k exchanges, this daemon's "
                "max_topk_exchanges_per_group; they are released with the group",
                **where,
            )
        if request.sequence not in group.exchanges:  # the exchange's first call: later ones join it
            self.quotas.check_caller(group, where)
        forming = group.exchanges.get(request.sequence)
        if forming is None:
            forming = group.exchanges[request.sequence] = Rendezvous(world_size, AGREED)
        if forming.failure is not None:
            raise forming.failure
        duplicate = f"rank {request.rank} already opened exchange {request.sequence}"
        disagreement = forming.arrive(request.rank, request, duplicate, where)
        if disagreement is not None:
            name, each = disagreement
            forming.fail(
                GroupMismatchError(
                    f"ranks disagree on the top-k exchange's {name}: {each}; nothing was allocated", group=group.name
                )
            )
            raise forming.failure
        if forming.complete:
            self._form(group, request.sequence, forming, devices)
        return await forming.wait(
            request.rank,
            exchange_timeout(request.timeout_seconds),
            # The exchange cannot form without every rank: forming without one that went away
            # would hand a token to no one and leave its peers' slabs half-used.
            OnStop.FAIL_ALL,
            timed_out=lambda missing: DeadlineExceededError(
                f"ranks {missing} did not open top-k exchange {request.sequence} in time; nothing was allocated",
                group=group.name,
            ),
            stopped=lambda: DeadlineExceededError(
                f"top-k exchange {request.sequence} did not open: rank {request.rank} stopped waiting "
                "for it (its call was cancelled or passed its deadline); nothing was allocated",
                group=group.name,
            ),
        )

    def _form(self, group: Group, sequence: int, forming: Rendezvous, devices: list[int]) -> None:
        first = forming.arrivals[0]
        layout = TopkLayout(first.max_rows, first.topk, group.args.world_size)
        on_gpus = group.args.device_kind == DeviceKind.CUDA
        if on_gpus:
            slab_bytes = _native.cuda_topk_slab_bytes(layout.rows_per_owner, layout.world_size, layout.topk)
            blocks = _native.cuda_topk_blocks(
                layout.rows_per_owner, layout.world_size, layout.topk, max_blocks_for(devices)
            )
        else:
            slab_bytes, blocks = layout.slab_bytes, 0
        try:
            self.quotas.check_exchange(group, slab_bytes * layout.world_size)
            if on_gpus:
                slabs = allocate_cuda_topk_slabs(group.name, sequence, devices, slab_bytes)
            else:
                slabs = allocate_topk_slabs(group.name, sequence, layout.world_size, slab_bytes)
        except ResourceExhaustedError as error:
            forming.fail(error)
            return
        try:
            members = {rank: group.members[rank] for rank in forming.arrivals}
            tokens = self.claims.issue_all(
                group.name, group.group_id, {rank: (m.pid, m.uid) for rank, m in members.items()}, slabs.fds,
                self.config.claim_token_ttl_seconds,
            )  # fmt: skip
        except OSError as error:  # out of descriptors handing them out: none was issued
            slabs.close()
            forming.fail(ResourceExhaustedError(f"handing out the slabs failed: {error.strerror}", group=group.name))
            return
        del group.exchanges[sequence]  # formed: only failures stay, for the ranks still to come
        group.topk_slabs.append(slabs)
        for placed in group.placement([slabs]):
            self.metrics.reserve(*placed)
        exchange_id = secrets.randbits(63)
        replies = {}
        for rank in forming.arrivals:
            reply = replies[rank] = pb.TopkExchangeReply(
                exchange_id=exchange_id,
                claim_token=tokens[rank],
                memory_kind=pb.CUDA_VMM_FD if on_gpus else pb.HOST_MEMFD,
                blocks=blocks,
                rows_per_owner=layout.rows_per_owner,
            )
            for owner in range(layout.world_size):
                reply.slabs.add(owner_rank=owner, size_bytes=slabs.slab_bytes)
        forming.succeed(replies)
        log.info(
            "top-k exchange opened",
            extra={"group": group.name, "sequence": sequence, "max_rows": first.max_rows, "topk": first.topk},
        )
