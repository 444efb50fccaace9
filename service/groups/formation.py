"""A group's formation: when the last rank arrives, what a formed group is built of. The quotas
checked, its memory allocated (host memfd, or CUDA VMM on each rank's GPU), its dispatch table,
its live evidence, its service path (on rank 0's GPU for a CUDA group) and a claim token per rank
for its descriptors. Anything that fails frees what was built and raises; the registry
(registry.py) then fails every waiting rank with that error."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from nodecomm import _native
from nodecomm.capabilities import DeviceKind
from nodecomm.errors import ResourceExhaustedError, UnsupportedError
from nodecomm.service.access.quotas import Quotas
from nodecomm.service.calibration.live_thresholds import LiveEstimates
from nodecomm.service.calibration.tables import TableKeeper
from nodecomm.service.config import DaemonConfig
from nodecomm.service.groups.adoption import SALT_BYTES, rank_secret, ticket_for
from nodecomm.service.groups.group import Group, Member
from nodecomm.service.groups.joining import FormingGroup
from nodecomm.service.memory.allocator import GroupMemory, allocate_group, max_blocks_for
from nodecomm.service.memory.handles import ClaimTable
from nodecomm.service.service_path.cuda_execution import CudaExecution
from nodecomm.service.service_path.submissions import SubmissionQueue
from nodecomm.thresholds import Wire
from nodecomm.v1 import control_pb2 as pb


@dataclass(frozen=True)
class Formation:
    config: DaemonConfig
    gpus: list[str]  # UUIDs of the GPUs this daemon sees, in its CUDA index order
    quotas: Quotas
    tables: TableKeeper
    claims: ClaimTable
    executor: Executor  # runs the service path's collectives
    on_service_done: Callable[[str, str, int], None]
    adoption_key: bytes  # the node's (service/groups/adoption.py): rank secrets and tickets

    def build(self, forming: FormingGroup) -> tuple[Group, dict[int, bytes], int]:
        """The formed group of `forming`'s arrivals, each rank's claim token, and the CUDA kernels'
        block limit (0 for a CPU group)."""
        first = forming.arrivals[0]
        joined = [forming.arrivals[rank] for rank in range(first.world_size)]
        self.quotas.check_group(first, [a.device for a in joined], forming.creator)
        devices = [None if a.device == DeviceKind.CPU else self.gpus.index(a.device) for a in joined]
        max_blocks = 0 if devices[0] is None else max_blocks_for(devices)
        memory = allocate_group(first.group, first.capacity_bytes, devices, self.config.cuda_memory)
        group_id, salt = secrets.randbits(63), secrets.token_bytes(SALT_BYTES)
        try:
            group = Group(
                name=first.group,
                group_id=group_id,
                args=first,
                memory=memory,
                table=self.tables.for_new_group(
                    first.device_kind, first.nccl_fallback, dict(first.overrides), Wire.from_proto(first.wire), devices
                ),
                members={
                    r: Member(r, pid=a.pid, uid=a.uid, secret=rank_secret(self.adoption_key, group_id, salt, r))
                    for r, a in enumerate(joined)
                },
                devices=[a.device for a in joined],
                creator=forming.creator,
                live=(
                    LiveEstimates(first.world_size, self.config.live_margin, self.config.live_min_samples)
                    if self.config.live_recalibration
                    else None
                ),
            )
            group.ticket = ticket_for(
                self.adoption_key,
                pb.GroupRecord(
                    group_id=group_id,
                    salt=salt,
                    join=first.to_request(),
                    ranks=[pb.RecordedRank(pid=a.pid, uid=a.uid, device=a.device) for a in joined],
                    memory_kind=memory.memory_kind,
                    buffer_bytes=memory.buffer_bytes,
                    creator_uid=forming.creator.uid or 0,
                    creator_is_tcp=forming.creator.uid is None,
                    max_blocks=max_blocks,
                    control_device=os.fstat(memory.control_fd).st_dev,
                    control_inode=os.fstat(memory.control_fd).st_ino,
                ),
            )
            depth = self.config.service_queue_depth
            # CUDA groups run the service path on rank 0's GPU, reading the others' over peer access.
            cuda = None
            if first.device_kind == DeviceKind.CUDA:
                executing = devices[0]
                words = self._stream_word_buffers(memory, executing)
                cuda = CudaExecution(executing, depth + 2, self.config.operation_timeout_seconds, words)
                if words is not None:
                    memory.unmap_later = cuda.unmap_later  # its stream waits on words in the buffers
            group.service = SubmissionQueue(
                group.name, first.world_size, first.dtypes, depth, self.executor, self.on_service_done, cuda
            )
            try:
                tokens = self.claims.issue_all(
                    group.name,
                    group.group_id,
                    {rank: (a.pid, a.uid) for rank, a in enumerate(joined)},
                    memory.descriptors(),
                    self.config.claim_token_ttl_seconds,
                )
            except OSError as error:  # out of descriptors (EMFILE): no rank is answered with a token
                raise ResourceExhaustedError(
                    f"handing out the group's descriptors failed: {error.strerror}; nothing was allocated",
                    group=first.group,
                ) from None
        except BaseException:
            memory.close()
            raise
        return group, tokens, max_blocks

    def _stream_word_buffers(self, memory: GroupMemory, executing: int) -> list[int] | None:
        """The daemon's address of every rank's buffer where the service path orders its streams by
        stream words (config cuda_service_ordering), None for IPC events. Stream words need 64-bit
        stream memory operations on every GPU, and the executing GPU's access to every buffer:
        granted here for VMM buffers on other GPUs; legacy buffers on other GPUs use IPC events."""
        setting = self.config.cuda_service_ordering
        if setting == "ipc-events":
            return None
        buffers = memory.rank_buffers
        devices = {device for device, _ in buffers} | {executing}
        lacking = sorted(d for d in devices if not _native.cuda_stream_words_supported(d))
        legacy_across = bool(memory.legacy_buffers) and len(devices) > 1
        if lacking or legacy_across:
            if setting == "stream-words":
                why = (
                    f"GPU {lacking} lacks 64-bit stream memory operations"
                    if lacking
                    else "legacy (cudaIpcMemHandle) buffers on several GPUs"
                )
                raise UnsupportedError(
                    f"cuda_service_ordering 'stream-words' cannot order this group's service path: {why}; "
                    "use 'auto' or 'ipc-events'"
                )
            return None
        for device, address in buffers:
            if device != executing:
                _native.cuda_vmm_grant(executing, address, memory.buffer_bytes)
        return [address for _, address in buffers]
