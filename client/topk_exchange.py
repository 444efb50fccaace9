"""TopkExchange: every rank's top-k candidates for a row, gathered at the row's owner.

Each source rank writes its candidates for owner o's rows straight into o's slab (no pack, no
all-to-all, no unpack), one barrier orders the writes before the owner reads, and the owner
copies its table out. Stages alternate between the slab's two slots: a slot written at stage n
is written again at stage n + 2 only after its owner passed stage n + 1's barrier, which it
reaches after copying stage n out. Layout: nodecomm.topk_layout.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

import grpc
import torch

from nodecomm import _native
from nodecomm.capabilities import DeviceKind
from nodecomm.errors import DaemonUnavailableError, InvalidArgumentError, from_rpc_error
from nodecomm.topk_layout import LAYOUT_VERSION, SLOTS, TopkLayout, owned_rows
from nodecomm.v1 import control_pb2 as pb
from nodecomm.v1 import control_pb2_grpc as pb_grpc

from . import topk_merge
from .descriptors import DescriptorSocket
from .mapping import SegmentMapping, map_descriptors
from .membership import Membership


def open_slabs(
    stub: pb_grpc.ControlStub,
    membership: Membership,
    metadata: tuple[tuple[str, bytes], ...],
    descriptor_socket: DescriptorSocket,
    sequence: int,
    max_rows: int,
    topk: int,
    timeout: float,
    device: int | None,
) -> tuple[TopkLayout, list[SegmentMapping], pb.TopkExchangeReply]:
    """Open the group's `sequence`-th top-k exchange with the daemon (every rank's call meets
    there) and map every owner's slab here, on `device` (None: host memory), once it is checked
    against this client's layout."""
    where = membership.where
    request = pb.TopkExchangeRequest(
        group=membership.group,
        group_id=membership.group_id,
        rank=membership.rank,
        sequence=sequence,
        max_rows=max_rows,
        topk=topk,
        layout_version=LAYOUT_VERSION,
        timeout_seconds=timeout,
    )
    try:
        reply = stub.OpenTopkExchange(request, timeout=timeout + 5.0, metadata=metadata)
    except grpc.RpcError as error:
        raise from_rpc_error(error, **where) from None
    world_size = membership.world_size
    layout = TopkLayout(max_rows, topk, world_size)
    on_gpu = device is not None
    if on_gpu:
        needed = _native.cuda_topk_slab_bytes(layout.rows_per_owner, layout.world_size, topk)
        fits = reply.memory_kind == pb.CUDA_VMM_FD and reply.rows_per_owner == layout.rows_per_owner
    else:
        needed, fits = layout.slab_bytes, reply.memory_kind == pb.HOST_MEMFD
    fds = descriptor_socket.claim(reply.claim_token, len(reply.slabs), timeout, where)
    try:
        sizes = [slab.size_bytes for slab in reply.slabs]
        if (
            not fits
            or len(sizes) != world_size
            or any(size < needed or (not on_gpu and size != needed) for size in sizes)
        ):
            raise DaemonUnavailableError(
                f"the daemon's slabs ({pb.MemoryKind.Name(reply.memory_kind)}, {sizes} bytes) are not "
                f"{world_size} of the {needed} bytes this client lays out for {max_rows} rows of {topk}",
                **where,
            )
        return layout, map_descriptors(fds, sizes, device, where), reply
    finally:
        for fd in fds:
            os.close(fd)


def _planes(mapping: SegmentMapping, layout: TopkLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(index plane, score-bits plane) of each slot, as int32 tensors over the mapped slab."""
    raw = torch.frombuffer((ctypes.c_char * mapping.size_bytes).from_address(mapping.address), dtype=torch.int32)
    shape = (layout.rows_per_owner, layout.world_size, layout.topk)
    planes = raw[: SLOTS * 2 * layout.plane_elements].view(SLOTS, 2, *shape)
    return [(planes[slot, 0], planes[slot, 1]) for slot in range(SLOTS)]


def check_candidates(
    local_idx: torch.Tensor, local_scores: torch.Tensor, topk: int, max_rows: int, device: torch.device, where: dict
) -> None:
    """A stage's inputs: [rows, topk] int32 indices and float32 scores on the group's device."""
    shape_ok = (
        isinstance(local_idx, torch.Tensor)
        and isinstance(local_scores, torch.Tensor)
        and local_idx.dim() == 2
        and local_idx.shape == local_scores.shape
        and local_idx.shape[1] == topk
    )
    if not shape_ok:
        shapes = [
            tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (local_idx, local_scores)
        ]
        raise InvalidArgumentError(
            f"local_idx and local_scores must both be [rows, {topk}] tensors, got {shapes[0]} and {shapes[1]}", **where
        )
    if local_idx.dtype != torch.int32 or local_scores.dtype != torch.float32:
        raise InvalidArgumentError(
            f"expected int32 indices and float32 scores, got {local_idx.dtype} and {local_scores.dtype}", **where
        )
    if local_idx.device != device or local_scores.device != device:
        raise InvalidArgumentError(
            f"this exchange belongs to a group on {device}; got tensors on {local_idx.device} and {local_scores.device}",
            **where,
        )
    if local_idx.shape[0] > max_rows:
        raise InvalidArgumentError(f"{local_idx.shape[0]} rows exceed the exchange's max_rows {max_rows}", **where)


class _Merge:
    """merge(), the DCP top-k merge on an exchange's stages (client/topk_merge.py)."""

    max_rows: int
    topk: int
    _rank: int
    _layout: TopkLayout
    _gather: topk_merge.Gather | None
    _where: dict
    _closed: bool
    _group_device: torch.device  # where the group's tensors live
    stage: topk_merge.Stage

    def merge(
        self,
        logits: torch.Tensor,
        topk_indices: torch.Tensor,
        cp_interleave: int = 1,
        row_starts: torch.Tensor | None = None,
        score_bits: int = 32,
        id_bits: int = 32,
    ) -> None:
        """Collective: overwrite `topk_indices` ([rows, topk] int32, this rank's top-k positions in
        its KV shard, -1 for none; rows the same on every rank, any number: past max_rows it runs
        in stages of max_rows) with the global top-k of every row, as global token ids, -1 where a
        row has fewer; `logits` ([rows, columns] float32) holds the scores they index, from
        `row_starts[row]` on where given. Every rank gets the same rows; the set in a row is
        vLLM's DCP merge's (vLLM's workspace.merge, with its arguments), by vLLM's key: the top
        `score_bits` of each score, then the smaller global id (its low `id_bits`). On CUDA it is
        enqueued on the current stream and capturable."""
        if self._closed:
            raise InvalidArgumentError("this top-k exchange is closed", **self._where)
        topk_merge.check_merge(
            logits,
            topk_indices,
            self.topk,
            self._group_device,
            cp_interleave,
            row_starts,
            score_bits,
            id_bits,
            self._where,
        )
        if self._gather is None:
            raise InvalidArgumentError("this exchange was opened without its group's all_gather", **self._where)
        topk_merge.merge(
            self.stage, self._gather, self.max_rows, self._rank, self._layout.world_size, logits, topk_indices,
            cp_interleave, row_starts, score_bits, id_bits,
        )  # fmt: skip


class TopkExchange(_Merge):
    """Built by Communicator.topk_exchange; stage() and merge() are collective, like every collective."""

    def __init__(
        self,
        layout: TopkLayout,
        rank: int,
        slabs: list[SegmentMapping],
        barrier: Callable[[int], None],
        where: dict,
        *,
        count: Callable[[int], None] = lambda nbytes: None,
        service_stage: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
        gather: topk_merge.Gather | None = None,
    ):
        self.max_rows, self.topk = layout.max_rows, layout.topk
        self._layout = layout
        self._rank = rank
        self._slabs = slabs
        self._planes = [_planes(slab, layout) for slab in slabs]
        self._barrier = barrier
        self._service_stage = service_stage
        self._count = count  # (bytes of candidates) for the daemon's operation counts
        self._gather = gather  # the group's all_gather, for merge()
        self._group_device = torch.device("cpu")
        self._where = where
        self._stages = 0
        self._closed = False

    def stage(
        self, local_idx: torch.Tensor, local_scores: torch.Tensor, *, path: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Send this rank's candidates ([rows, topk]: int32 indices, float32 scores; rows <= max_rows,
        the same on every rank) to the rows' owners; returns this rank's owner table, (idx, scores)
        each [owned_rows, world_size, topk], where [i, s, :] is exactly what rank s passed for the
        i-th owned row, bit for bit. path="service": the daemon moves the candidates (the same bits)."""
        self._check(local_idx, local_scores)
        if path is not None:
            if path != "service" or self._service_stage is None:
                raise InvalidArgumentError(f"path {path!r}: expected None or 'service'", **self._where)
            return self._service_stage(local_idx.contiguous(), local_scores.contiguous())
        rows, world = local_idx.shape[0], self._layout.world_size
        slot = self._stages % SLOTS
        self._stages += 1
        source_idx, source_bits = local_idx, local_scores.view(torch.int32)  # bits, not values
        for owner in range(world):
            span = owned_rows(rows, world, owner)
            if span:
                idx_plane, score_plane = self._planes[owner][slot]
                idx_plane[: len(span), self._rank].copy_(source_idx[span.start : span.stop])
                score_plane[: len(span), self._rank].copy_(source_bits[span.start : span.stop])
        self._barrier(rows)  # GroupMismatchError where the ranks staged different row counts
        self._count(2 * local_idx.numel() * 4)
        mine = len(owned_rows(rows, world, self._rank))
        idx_plane, score_plane = self._planes[self._rank][slot]
        return idx_plane[:mine].clone(), score_plane[:mine].clone().view(torch.float32)

    def _check(self, local_idx: torch.Tensor, local_scores: torch.Tensor) -> None:
        if self._closed:
            raise InvalidArgumentError("this top-k exchange is closed", **self._where)
        check_candidates(local_idx, local_scores, self.topk, self.max_rows, torch.device("cpu"), self._where)

    def close(self) -> None:
        """Unmap the slabs here (the daemon frees them with the group). Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        self._planes = []
        for slab in self._slabs:
            slab.unmap()


class CudaTopkExchange(_Merge):
    """A CUDA group's exchange: each stage is one kernel on the current stream (capturable in a
    CUDA graph), writing into the owners' slabs on their GPUs (native/cuda/topk.h); the grid and
    the slab geometry are the daemon's, the same for every rank."""

    def __init__(
        self,
        layout: TopkLayout,
        rank: int,
        slabs: list[SegmentMapping],
        transport,
        run: Callable[..., None],
        blocks: int,
        timeout: float,
        where: dict,
        *,
        count: Callable[[int], None] = lambda nbytes: None,
        service_stage: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
        gather: topk_merge.Gather | None = None,
    ):
        self.max_rows, self.topk = layout.max_rows, layout.topk
        self._layout = layout
        self._rank = rank
        self._slabs = slabs
        self._service_stage = service_stage
        self._addresses = [slab.address for slab in slabs]
        self._transport = transport
        self._run = run  # the communicator's: its lock, and a lost peer or daemon raised before launching
        self._blocks = blocks
        self._timeout = timeout
        self._where = where
        self._count = count
        self._gather = gather  # the group's all_gather, for merge()
        self._group_device = transport.device
        self._closed = False

    def stage(
        self, local_idx: torch.Tensor, local_scores: torch.Tensor, *, path: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As TopkExchange.stage, enqueued on the current stream: the tables are new tensors that
        hold the result once the stream reaches the end of the stage. A stage whose kernel gives up
        (a peer lost, or past the timeout) leaves them unwritten; the next call raises why."""
        if self._closed:
            raise InvalidArgumentError("this top-k exchange is closed", **self._where)
        check_candidates(local_idx, local_scores, self.topk, self.max_rows, self._transport.device, self._where)
        local_idx, local_scores = local_idx.contiguous(), local_scores.contiguous()
        if path is not None:
            if path != "service" or self._service_stage is None:
                raise InvalidArgumentError(f"path {path!r}: expected None or 'service'", **self._where)
            return self._service_stage(local_idx, local_scores)
        rows, world = local_idx.shape[0], self._layout.world_size
        owned = len(owned_rows(rows, world, self._rank))
        out_idx = torch.empty((owned, world, self.topk), dtype=torch.int32, device=local_idx.device)
        out_scores = torch.empty((owned, world, self.topk), dtype=torch.float32, device=local_idx.device)
        self._run(
            self._transport.topk_stage, self._addresses, self._layout.rows_per_owner, self.topk, self._blocks,
            local_idx, local_scores, out_idx, out_scores, self._timeout,
        )  # fmt: skip
        self._count(2 * local_idx.numel() * 4)
        return out_idx, out_scores

    def close(self) -> None:
        """Unmap the slabs here, once this device's work on them is done."""
        if self._closed:
            return
        self._closed = True
        self._transport.unmap(self._slabs)


class TopkExchanges:
    """A communicator's top-k exchanges: each opened with the daemon as the group's next (every
    rank's n-th call meets the others', failed or not), built for the group's device, and closed
    with the communicator. `run(operation, *args)` runs a transport operation as the communicator
    does; the callbacks are as TopkExchange's."""

    def __init__(
        self,
        membership: Membership,
        metadata: tuple[tuple[str, bytes], ...],
        descriptor_socket: DescriptorSocket,
        transport,
        run: Callable[..., None],
        operation_timeout: float,
        lock: _native.CallLock,
        *,
        count: Callable[[int], None],
        service_stage: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        gather: topk_merge.Gather,
    ):
        self._membership = membership
        self._metadata = metadata
        self._descriptor_socket = descriptor_socket
        self._transport = transport
        self._run = run
        self._operation_timeout = operation_timeout
        self._lock = lock  # the communicator's, which close() takes
        self._callbacks = dict(count=count, service_stage=service_stage, gather=gather)
        self._calls = 0
        self._opened: list[TopkExchange | CudaTopkExchange] = []

    def next_sequence(self) -> int:
        """The number of the next exchange opened (called under the communicator's lock)."""
        self._calls += 1
        return self._calls - 1

    def open(
        self, stub: pb_grpc.ControlStub, sequence: int, max_rows: int, topk: int, timeout: float
    ) -> TopkExchange | CudaTopkExchange:
        membership, transport = self._membership, self._transport
        device = transport.device.index if transport.kind == DeviceKind.CUDA else None
        layout, slabs, reply = open_slabs(
            stub, membership, self._metadata, self._descriptor_socket, sequence, max_rows, topk, timeout, device
        )
        if device is not None:
            exchange = CudaTopkExchange(
                layout, membership.rank, slabs, transport, self._run, reply.blocks, self._operation_timeout,
                membership.where, **self._callbacks,
            )  # fmt: skip
        else:
            exchange = TopkExchange(layout, membership.rank, slabs, self._barrier, membership.where, **self._callbacks)
        with self._lock:
            self._opened.append(exchange)
        return exchange

    def _barrier(self, rows: int) -> None:
        self._run(self._transport.topk_barrier, rows, self._operation_timeout)

    def close(self) -> None:
        for exchange in self._opened:
            exchange.close()
