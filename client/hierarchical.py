"""HierarchicalCommunicator: a group whose ranks sit on several nodes.

Inside each node the node's daemon serves a nodecomm group of the node's ranks; between nodes,
torch.distributed process groups that this module builds on the job's c10d store (gloo for CPU
tensors, NCCL for CUDA ones) carry the node sums. nodecomm never moves a byte between nodes.

The message is cut into S shards, S the most ranks any node has; on a node of L ranks, local rank
l owns the shards s with s % L == l, and shard s's owners on every node form its cross group.

    all_reduce(x)   1. the node's lossless all-reduce: every rank holds its node's sum, rounded
                       once to the dtype
                    2. each cross group all-gathers its shard of the node sums, and every member
                       adds them in fp32 in node order, rounding once
                    3. the node's ranks all-gather the shards they own
    all_gather(x)   the same three steps on bytes: the node's rows, then shards of them across
                    nodes, then inside the node

Up to the table's flat_max_bytes, step 2 exchanges the whole node sum and step 3 is skipped (the
"flat" form; across_nodes_forms.py says how the boundary is probed and follows live timings).
Every rank gets the same bits either way. They are not the single-node lossless sum's: each node's
sum is rounded to the dtype before the nodes' sums are added (docs/multi-node.md states the bound).

A failure anywhere is put on record in the store, so that every rank waiting elsewhere (inside its
node, or between nodes) raises naming it within its timeout; the communicator then refuses further
calls and close() releases the node's group.
"""

from __future__ import annotations

import dataclasses
import socket as sockets
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from nodecomm.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    NodecommError,
    PeerLostError,
    UnsupportedError,
)
from nodecomm.socket_path import default_socket_path

from .across_nodes_forms import AcrossNodesForms, AcrossNodesTable, Form, probe_boundary
from .communicator import Communicator

Result = TypeVar("Result")

# The sizes the probe at connect times both forms at (float32 zeros), and how often each.
PROBE_SIZES = tuple(1 << shift for shift in range(10, 23, 2))  # 1 KiB .. 4 MiB
_PROBE_RUNS = 3
# How often a rank waiting between nodes looks for a failure on record.
_FAILURE_POLL_SECONDS = 0.05
# How long a rank whose inter-node step broke waits for the failure behind it to be put on record.
_EXPLANATION_WAIT_SECONDS = 2.0


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """The group's ranks by node: `nodes[k]` lists node k's ranks in rank order, nodes ordered by
    their lowest rank; `names[k]` is what node k's ranks called their node."""

    nodes: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]

    @classmethod
    def of(cls, node_names: list[str]) -> NodeLayout:
        """From every rank's node name, in rank order."""
        order: dict[str, list[int]] = {}
        for rank, name in enumerate(node_names):
            order.setdefault(name, []).append(rank)
        return cls(tuple(tuple(ranks) for ranks in order.values()), tuple(order))

    def node_of(self, rank: int) -> int:
        return next(k for k, ranks in enumerate(self.nodes) if rank in ranks)

    @property
    def shards(self) -> int:
        return max(len(ranks) for ranks in self.nodes)

    def owner(self, node: int, shard: int) -> int:
        ranks = self.nodes[node]
        return ranks[shard % len(ranks)]

    def cross_group(self, shard: int) -> tuple[int, ...]:
        """Shard's owners, one per node, in node order."""
        return tuple(self.owner(k, shard) for k in range(len(self.nodes)))

    def owned(self, rank: int) -> list[int]:
        node = self.node_of(rank)
        return [s for s in range(self.shards) if self.owner(node, s) == rank]


def shard_bounds(count: int, shards: int) -> list[tuple[int, int]]:
    """[lo, hi) of each shard of `count` elements: near-equal, in whole multiples of 16."""
    per = -(-count // shards)
    per = -(-per // 16) * 16
    return [(min(count, s * per), min(count, (s + 1) * per)) for s in range(shards)]


class FailureRecord:
    """Failures put on record in the job's store under `prefix`, one key per rank, so that a rank
    waiting anywhere learns what broke the group instead of only that its own wait failed."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, world_size: int):
        self._store, self._prefix, self._rank, self._world_size = store, prefix, rank, world_size

    def put(self, what: str) -> None:
        try:
            self._store.set(f"{self._prefix}/failed/{self._rank}", what)
            self._store.add(f"{self._prefix}/failures", 1)
        except Exception:  # noqa: BLE001 (the store may have died with the node that hosted it)
            pass

    def any(self) -> bool:
        try:
            return self._store.add(f"{self._prefix}/failures", 0) > 0
        except Exception:  # noqa: BLE001
            return False

    def read(self) -> list[str]:
        found = []
        for rank in range(self._world_size):
            key = f"{self._prefix}/failed/{rank}"
            try:
                if self._store.check([key]):
                    found.append(self._store.get(key).decode())
            except Exception:  # noqa: BLE001
                break
        return found


class HierarchicalCommunicator:
    """A rank's membership in a group across nodes; build it with `connect_across_nodes`. It has
    the calls torch.distributed's collectives are built from (all_reduce, all_gather, barrier),
    each called by every rank of the group in the same order with the same sizes."""

    def __init__(
        self,
        *,
        node: Communicator,
        layout: NodeLayout,
        rank: int,
        cross_groups: dict[int, dist.ProcessGroup],
        failures: FailureRecord,
        forms: AcrossNodesForms,
        store: dist.Store,
        prefix: str,
        timeout: float,
    ):
        self.node = node  # this node's nodecomm group
        self.layout = layout
        self.rank, self.world_size = rank, sum(len(ranks) for ranks in layout.nodes)
        self.group = node.group
        self.device = node.device
        self.forms = forms
        self._store, self._prefix = store, prefix
        self._timed: list[tuple[Form, int, Callable[[], float]]] = []  # rank 0's calls not yet read
        self._node_index = layout.node_of(rank)
        self._cross_groups = cross_groups
        self._owned = layout.owned(rank)
        self._failures = failures
        self._timeout = timeout
        self._broken: str | None = None

    # -- collectives ---------------------------------------------------------------------------

    def native_lane(self) -> None:
        """None: a call across nodes runs in Python (the c10d backend leaves it to this object)."""
        return None

    def all_reduce(
        self, tensor: torch.Tensor, *, out: torch.Tensor | None = None, form: str | None = None
    ) -> torch.Tensor:
        """The sum over every rank (float32 / float16 / bfloat16), the same bits on every rank.
        form: "flat" or "sharded" to force one (every rank alike); default: the table's."""
        self._check_usable()
        values = tensor.contiguous().view(-1)
        nbytes = values.numel() * values.element_size()
        chosen = self.forms.decide(nbytes)[0] if form is None else _parsed_form(form)
        stopwatch = _Stopwatch(values.device) if self.rank == 0 and self.forms.live and form is None else None
        partial = self._inside(lambda: self.node.all_reduce(values))
        sums = self._across(partial, partial.element_size(), self._sum_of, form=chosen).reshape(tensor.shape)
        if stopwatch is not None:
            self._timed.append((chosen, nbytes, stopwatch.stop()))
        if form is None and self.forms.switch_due():
            self._switch_table()
        if out is None:
            return sums
        out.copy_(sums)
        return out

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`: [world_size, *shape], row r from rank r."""
        self._check_usable()
        row = tensor.contiguous().view(-1)
        node_rows = self._inside(lambda: self.node.all_gather(row))  # [L, n] of this node
        width = self.layout.shards  # every node's block padded to the same rows
        block = torch.zeros(width, row.numel(), dtype=row.dtype, device=row.device)
        block[: node_rows.shape[0]] = node_rows.view(node_rows.shape[0], -1)
        nodes = len(self.layout.nodes)
        flat = block.view(-1).view(torch.uint8)
        blocks = self._across(flat, 1, self._stacked, nodes, form=self.forms.table.form_for(flat.numel()))
        blocks = blocks.view(row.dtype).view(nodes, width, row.numel())
        out = torch.empty(self.world_size, row.numel(), dtype=row.dtype, device=row.device)
        for k, ranks in enumerate(self.layout.nodes):
            out[list(ranks)] = blocks[k, : len(ranks)]
        return out.view(self.world_size, *tensor.shape)

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))

    # -- the steps -----------------------------------------------------------------------------

    @property
    def table(self) -> AcrossNodesTable:
        """Which form carries each size between nodes, as every rank holds it now."""
        return self.forms.table

    def _across(
        self,
        local: torch.Tensor,
        unit: int,
        combine: Callable[[list[torch.Tensor]], torch.Tensor],
        scale: int = 1,
        *,
        form: Form,
    ) -> torch.Tensor:
        """Steps 2 and 3 on this node's `local` (1-D, `unit` bytes an element): per shard this rank
        owns, combine(every node's part), which holds `scale` rows of the part's length; then the
        node's ranks gather the shards (the sharded form), or each node's whole `local` crosses
        (flat). Returns the combined whole, [scale, local.numel()]."""
        count = local.numel()
        if count == 0:  # every rank passed nothing: nothing to exchange
            return local.new_empty(scale, 0)
        if form is Form.FLAT or count < self.layout.shards:
            combined = [combine(self._cross_gather(s, local)) for s in self._owned]
            return combined[0].view(scale, count)
        bounds = shard_bounds(count, self.layout.shards)
        pieces = [combine(self._cross_gather(s, local[slice(*bounds[s])])).view(-1) for s in self._owned]
        owned_by = [self.layout.owned(rank) for rank in self.layout.nodes[self._node_index]]
        longest = max(sum(bounds[s][1] - bounds[s][0] for s in shards) for shards in owned_by)
        mine = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if mine.numel() < longest * scale:
            mine = torch.cat([mine, mine.new_zeros(longest * scale - mine.numel())])
        rows = self._inside(lambda: self.node.all_gather(mine))
        if scale == 1 and all(shards == [local] for local, shards in enumerate(owned_by)):
            return rows.view(1, -1)[:, :count]  # row i is shard i: the rows are the whole
        whole = torch.empty(scale, count, dtype=mine.dtype, device=mine.device)
        for row, shards in zip(rows, owned_by, strict=True):
            offset = 0
            for s in shards:
                lo, hi = bounds[s]
                whole[:, lo:hi] = row[offset : offset + (hi - lo) * scale].view(scale, hi - lo)
                offset += (hi - lo) * scale
        return whole

    @staticmethod
    def _sum_of(parts: list[torch.Tensor]) -> torch.Tensor:
        """The nodes' sums added in fp32 in node order, rounded once."""
        total = parts[0].to(torch.float32, copy=True)
        for part in parts[1:]:
            total += part.float()
        return total.to(parts[0].dtype)

    @staticmethod
    def _stacked(parts: list[torch.Tensor]) -> torch.Tensor:
        """The nodes' parts back to back, in node order (all_gather's combine)."""
        return torch.stack(parts).view(-1)

    def _cross_gather(self, shard: int, part: torch.Tensor) -> list[torch.Tensor]:
        """Every node's `part` of `shard`, in node order, through the shard's cross group."""
        group = self._cross_groups[shard]
        raw = part.contiguous().view(torch.uint8)  # bytes: gloo's allgather knows no bfloat16
        gathered = [torch.empty_like(raw) for _ in range(group.size())]
        members = self.layout.cross_group(shard)
        self._wait(group.allgather([gathered], [raw]), f"the inter-node step among ranks {list(members)}")
        return [g.view(part.dtype) for g in gathered]

    # -- the table -----------------------------------------------------------------------------

    def _switch_table(self) -> None:
        """Every rank takes the table rank 0 holds after this call: rank 0 reads its timings,
        moves the boundary where they demand it and puts the table in the store."""
        key = f"{self._prefix}/table/{self.forms.calls // self.forms.policy.switch_period}"
        if self.rank == 0:
            for form, nbytes, seconds in self._timed:
                self.forms.record(form, nbytes, seconds())
            self._timed.clear()
            self.forms.table = self.forms.proposed()
            self._store.set(key, self.forms.table.encoded())
            previous = f"{self._prefix}/table/{self.forms.calls // self.forms.policy.switch_period - 1}"
            self._store.delete_key(previous)  # every rank read it before the call just made
        else:
            self.forms.table = AcrossNodesTable.decoded(self._read(key))

    def _read(self, key: str) -> bytes:
        """A key rank 0 sets, within the operation timeout."""
        try:
            self._store.wait([key], timedelta(seconds=self._timeout))
        except Exception as error:  # noqa: BLE001 (torch raises DistStoreError, a RuntimeError)
            self._fail(f"rank {self.rank} waited {self._timeout:.0f} s for rank 0's table ({key}): {error}")
            raise self._failure_error(DeadlineExceededError) from None
        return self._store.get(key)

    def probe(self) -> AcrossNodesTable:
        """Run both forms at PROBE_SIZES on every rank; the boundary rank 0 timed becomes every
        rank's table. Every rank of the group calls it at once."""
        timings: dict[Form, dict[int, float]] = {Form.FLAT: {}, Form.SHARDED: {}}
        for nbytes in PROBE_SIZES:
            values = torch.zeros(nbytes // 4, device=self.device)
            for form in Form:
                self.all_reduce(values, form=form.value)  # warm-up, and the ranks line up
                seconds = []
                for _ in range(_PROBE_RUNS):
                    stopwatch = _Stopwatch(values.device) if self.rank == 0 else None
                    self.all_reduce(values, form=form.value)
                    if stopwatch is not None:
                        seconds.append(stopwatch.stop())
                if seconds:
                    timings[form][nbytes] = sorted(read() for read in seconds)[_PROBE_RUNS // 2]
        key = f"{self._prefix}/table/probe"
        if self.rank == 0:
            boundary = probe_boundary(timings[Form.FLAT], timings[Form.SHARDED])
            self._store.set(key, AcrossNodesTable(boundary, "probe").encoded())
        self.forms.table = AcrossNodesTable.decoded(self._read(key))
        return self.forms.table

    # -- failures ------------------------------------------------------------------------------

    def _inside(self, step: Callable[[], Result]) -> Result:
        """A step inside the node: a failure there is put on record for the other nodes; where
        another node's failure came first, that is what this rank raises."""
        try:
            return step()
        except (InvalidArgumentError, UnsupportedError):
            raise  # a bad call, refused before anything moved: the group is fine
        except NodecommError as error:
            ranks = list(self.layout.nodes[self._node_index])
            self._fail(f"on node {self._node_index} (its local ranks 0..{len(ranks) - 1} are ranks {ranks}): {error}")
            raise self._failure_error(type(error)) from error

    def _wait(self, work: dist.Work, what: str) -> None:
        """Wait for an inter-node step, ending early when a failure is on record; bounded by the
        operation timeout."""
        done = threading.Event()
        work.get_future().add_done_callback(lambda _: done.set())
        deadline = time.monotonic() + self._timeout
        while not done.wait(_FAILURE_POLL_SECONDS):
            if self._failures.any():
                self._fail(f"rank {self.rank} left {what}: a failure was on record")
                raise self._failure_error(PeerLostError)
            if time.monotonic() > deadline:
                self._fail(f"rank {self.rank} waited {self._timeout:.0f} s in {what}")
                raise self._failure_error(DeadlineExceededError)
        try:
            work.wait()
        except Exception as error:  # noqa: BLE001 (gloo and NCCL raise RuntimeError and its kin)
            # A peer's connection broke: the rank or node behind it says why once it notices.
            explained = time.monotonic() + _EXPLANATION_WAIT_SECONDS
            while not self._failures.any() and time.monotonic() < explained:
                time.sleep(_FAILURE_POLL_SECONDS)
            self._fail(f"rank {self.rank}: {what} failed: {error}")
            raise self._failure_error(PeerLostError) from None

    def _fail(self, what: str) -> None:
        """Put `what` on record and leave the node's group, whose other ranks then stop waiting
        for this one (the daemon releases the group once they have left too)."""
        self._failures.put(what)
        self._broken = self._broken or what
        self.node.close()

    def _failure_error(self, kind: type[NodecommError]) -> NodecommError:
        notes = self._failures.read() or [self._broken or "unknown"]
        return kind(
            "the group across nodes failed: " + " | ".join(dict.fromkeys(notes)) + "; close this communicator",
            group=self.group,
            rank=self.rank,
        )

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise self._failure_error(PeerLostError)

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Leave this node's group (the daemon releases it once every rank of the node left)."""
        self.node.close()

    def __enter__(self) -> HierarchicalCommunicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Stopwatch:
    """A call's time: the wall clock on CPU, events on the current stream on CUDA (read later, so
    timing never waits for the GPU)."""

    def __init__(self, device: torch.device):
        if device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> Callable[[], float]:
        """Ends the timing; returns what reads it in seconds."""
        if isinstance(self._start, float):
            seconds = time.perf_counter() - self._start
            return lambda: seconds
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        start = self._start

        def read() -> float:
            end.synchronize()
            return start.elapsed_time(end) / 1000

        return read


def _parsed_form(name: str) -> Form:
    try:
        return Form(name)
    except ValueError:
        raise InvalidArgumentError(f"form {name!r}: expected 'flat' or 'sharded'") from None


def node_name(socket: str | None) -> str:
    """What a rank calls its node: the host and the daemon it uses (two daemons on one host stand
    for two nodes)."""
    return f"{sockets.gethostname()}|{socket or default_socket_path()}"


def connect_across_nodes(
    group: str,
    rank: int | None = None,
    world_size: int | None = None,
    *,
    store: dist.Store | None = None,
    node: str | None = None,
    device: str | torch.device = "cpu",
    socket: str | None = None,
    timeout: float = 60.0,
    flat_max_bytes: int | None = None,
    recalibrate: bool = True,
    **connect_options,
) -> HierarchicalCommunicator:
    """Join `group` as `rank` of `world_size` across nodes: this node's ranks through this node's
    daemon (`socket`), the nodes through torch.distributed groups built on `store`.

    store, rank, world_size: the job's c10d store and this rank's place in the group (default: the
    default process group's store, rank and size). node: what this rank calls its node (default:
    the host and the daemon socket); ranks with the same name share a node. flat_max_bytes: up to
    what size an all-reduce sends each node's whole sum between nodes (default: what a probe of
    both forms at connect shows); recalibrate: whether live timings move that boundary. The other
    options are `nodecomm.connect`'s, for the node's group. Every rank of the group makes this call.
    """
    import nodecomm

    if store is None:
        if not dist.is_initialized():
            raise InvalidArgumentError(
                "connect_across_nodes needs the job's c10d store: pass store=, rank= and world_size=, "
                "or call torch.distributed.init_process_group first"
            )
        store = dist.distributed_c10d._get_default_store()
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    if rank is None or world_size is None or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"rank {rank} of world_size {world_size}: expected 0 <= rank < world_size")
    prefix = f"nodecomm/across/{group}"
    names = _exchange_names(store, prefix, rank, world_size, node or node_name(socket), timeout)
    layout = NodeLayout.of(names)
    k = layout.node_of(rank)
    local = nodecomm.connect(
        group, layout.nodes[k].index(rank), len(layout.nodes[k]), device=device, socket=socket, timeout=timeout,
        **connect_options,
    )  # fmt: skip
    operation_timeout = local.operation_timeout
    try:
        cross = _cross_groups(store, prefix, layout, rank, local.device, timeout)
    except Exception:
        local.close()
        raise
    one_shard = layout.shards == 1 or len(layout.nodes) == 1  # the two forms are the same
    if flat_max_bytes is not None and flat_max_bytes < 0:
        local.close()
        raise InvalidArgumentError(f"flat_max_bytes {flat_max_bytes}: expected 0 or more bytes")
    table = AcrossNodesTable(0, "one shard") if one_shard else AcrossNodesTable(flat_max_bytes or 0, "caller")
    comm = HierarchicalCommunicator(
        node=local, layout=layout, rank=rank, cross_groups=cross,
        failures=FailureRecord(store, prefix, rank, world_size),
        forms=AcrossNodesForms(table, live=recalibrate and not one_shard), store=store, prefix=prefix,
        timeout=operation_timeout,
    )  # fmt: skip
    if flat_max_bytes is None and not one_shard:
        try:
            comm.probe()
        except Exception:
            comm.close()
            raise
    return comm


def _exchange_names(store: dist.Store, prefix: str, rank: int, world_size: int, name: str, timeout: float) -> list[str]:
    store.set(f"{prefix}/node/{rank}", name)
    keys = [f"{prefix}/node/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception as error:  # noqa: BLE001 (torch raises DistStoreError, a RuntimeError)
        raise DeadlineExceededError(f"not every rank of {world_size} joined within {timeout} s: {error}") from None
    return [store.get(key).decode() for key in keys]


def _cross_groups(
    store: dist.Store, prefix: str, layout: NodeLayout, rank: int, device: torch.device, timeout: float
) -> dict[int, dist.ProcessGroup]:
    """A process group per shard this rank owns, made in shard order (so that a rank owning
    several never waits for a peer that waits for it)."""
    groups = {}
    for shard in layout.owned(rank):
        members = layout.cross_group(shard)
        scoped = dist.PrefixStore(f"{prefix}/cross/{shard}/", store)
        if device.type == "cuda":
            groups[shard] = dist.ProcessGroupNCCL(scoped, members.index(rank), len(members))
        else:
            groups[shard] = dist.ProcessGroupGloo(scoped, members.index(rank), len(members), timedelta(seconds=timeout))
    return groups
