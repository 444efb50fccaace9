"""The service path's memory: what a rank asks for (AllocateMemory) so that its tensors go to the
daemon by reference, allocated within the quotas on the rank's host or GPU, mapped by the daemon,
and handed to the rank as a claim token for its descriptor."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from nodecomm.capabilities import DeviceKind
from nodecomm.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from nodecomm.service.access.quotas import Quotas
from nodecomm.service.config import DaemonConfig
from nodecomm.service.groups.state import GroupState
from nodecomm.service.memory.allocator import allocate_rank_device_memory, allocate_rank_memory
from nodecomm.service.memory.handles import ClaimTable
from nodecomm.service.metrics.families import DaemonMetrics
from nodecomm.service.service_path.submissions import SubmissionQueue
from nodecomm.v1 import control_pb2 as pb

if TYPE_CHECKING:
    from nodecomm.service.groups.group import Group


class ServiceMemory:
    def __init__(self, config: DaemonConfig, metrics: DaemonMetrics, claims: ClaimTable, quotas: Quotas):
        self.config = config
        self.metrics = metrics
        self.claims = claims
        self.quotas = quotas
        self._ids = itertools.count(1)

    def allocate(
        self, group: Group, service: SubmissionQueue, request: pb.AllocateMemoryRequest, devices: list[int]
    ) -> pb.AllocateMemoryReply:
        """Memory for `request.rank` of `group` (on a CUDA group, rank r's GPU is daemon index
        devices[r]), mapped by the daemon too, and a claim token for its descriptor."""
        where = dict(group=group.name, rank=request.rank)
        if group.state != GroupState.ACTIVE:
            raise NotFoundError(f"the group is {group.state}", **where)
        size = request.size_bytes
        if not 1 <= size <= self.config.max_capacity_bytes * group.args.world_size:
            raise InvalidArgumentError(
                f"size_bytes {size}: expected 1..{self.config.max_capacity_bytes * group.args.world_size} "
                "(world_size times this daemon's max_capacity_bytes)",
                **where,
            )
        held = sum(1 for a in service.allocations.values() if a.rank == request.rank and not a.freed)
        self.quotas.check_allocation(group, held, size, where)
        allocation_id = next(self._ids)
        if group.args.device_kind == DeviceKind.CUDA:
            allocation = allocate_rank_device_memory(
                group.name, request.rank, allocation_id, size, devices[request.rank], group.devices[request.rank],
                devices[0],
            )  # fmt: skip
        else:
            allocation = allocate_rank_memory(group.name, request.rank, allocation_id, size)
        service.add_allocation(allocation)
        try:
            token = self.claims.issue(
                group.name,
                group.group_id,
                request.rank,
                group.members[request.rank].pid,
                group.members[request.rank].uid,
                [allocation.fd],
                self.config.claim_token_ttl_seconds,
            )
        except OSError as error:  # out of descriptors (EMFILE): no rank could ever free it
            service.free(request.rank, allocation.allocation_id)
            raise ResourceExhaustedError(
                f"handing out the allocation's descriptor failed: {error.strerror}; nothing was allocated", **where
            ) from None
        self.metrics.reserve(*allocation.placement, "service", allocation.size_bytes)
        kind = pb.CUDA_VMM_FD if group.args.device_kind == DeviceKind.CUDA else pb.HOST_MEMFD
        return pb.AllocateMemoryReply(
            allocation_id=allocation.allocation_id,
            claim_token=token,
            memory_kind=kind,
            size_bytes=allocation.size_bytes,
        )

    def free(self, service: SubmissionQueue, request: pb.FreeMemoryRequest) -> None:
        allocation = service.free(request.rank, request.allocation_id)
        self.metrics.reserve(*allocation.placement, "service", -allocation.size_bytes)
