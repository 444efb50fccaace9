"""NodecommProcessGroup: what the "nodecomm" backend runs in Python, one process group's operations.

torch holds the C++ backend (nodecomm._c10d.Backend); it runs an all-reduce SUM natively and hands
every other operation to the methods below by their Python names (torch's own). Each maps torch's
arguments onto a node group's Communicator through nodecomm.distributed.collectives and returns a Work.
"""

from __future__ import annotations

import concurrent.futures
import functools
import re
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from nodecomm.client.daemon_choice import DaemonChoice, JobLeaseHandle
from nodecomm.errors import InvalidArgumentError, UnsupportedError

from . import collectives
from .collectives import RedOp, check_reducible, reduce_op_type
from .node_groups import NodeGroup
from .sends import SendLedger
from .work import Work

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def _device_of(tensors: list[torch.Tensor]) -> torch.device:
    if len(tensors) == 1 and tensors[0].device.type in ("cpu", "cuda"):
        return tensors[0].device
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise InvalidArgumentError(f"the tensors of one call must share a device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"nodecomm runs on cpu and cuda tensors, got one on {device}")
    return device


def _check_dense(tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        if tensor.layout != torch.strided:
            raise UnsupportedError(f"nodecomm reduces dense (strided) tensors, got a {tensor.layout} one")


def _like(what: str, tensors: list[torch.Tensor], like: torch.Tensor, named: str) -> None:
    """Raise unless every tensor holds as many elements as `like`, of its dtype (checked before any
    data moves, as gloo does)."""
    for index, tensor in enumerate(tensors):
        if tensor.numel() != like.numel() or tensor.dtype != like.dtype:
            raise InvalidArgumentError(
                f"{what}: tensor {index} holds {tensor.numel()} {tensor.dtype}; expected {like.numel()} "
                f"{like.dtype}, as {named}"
            )


def _one(tensors: list, what: str):
    if len(tensors) != 1:
        raise InvalidArgumentError(f"{what}: expected one tensor per process, got {len(tensors)}")
    return tensors[0]


def _copy_into(destinations: list[torch.Tensor], rows: torch.Tensor) -> None:
    for destination, row in zip(destinations, rows, strict=True):
        destination.copy_(row.view(destination.shape))


class NodecommProcessGroup:
    """One process group's operations on nodecomm groups: one per device type for the collectives,
    joined on first use, and one per (source, destination, tag) for send/recv."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        *,
        name: str,
        timeout: timedelta,
        connect_options: Mapping[str, object],
        daemon: DaemonChoice | None = None,
        daemon_lease: JobLeaseHandle | None = None,
        node_names: list[str] | None = None,
        global_ranks: list[int] | None = None,
        processes: list[tuple[str, int, int]] | None = None,
    ):
        self._store = store
        self._global_ranks = global_ranks or list(range(size))  # by group rank: what errors name
        # Each rank's (machine and pid namespace, pid, start time): a node group's join waits no longer
        # for a rank whose process, seen from here, has ended.
        self._processes = processes or []
        self._rank = rank
        self._size = size
        self.nodecomm_name = name  # the nodecomm groups' names start with it
        self.daemon = daemon  # the node's or the job's own, as the group's rank 0 chose
        self._daemon_lease = daemon_lease
        # The group's timeout (init_process_group(timeout=...)) bounds joining and every wait.
        seconds = timeout.total_seconds()
        self._options = {**connect_options, "timeout": seconds, "operation_timeout": seconds}
        # Across nodes: every rank's node name; each node group then spans the nodes.
        self._node_names = node_names
        self._collective_groups: dict[str, NodeGroup] = {}
        self._pair_groups: dict[tuple[str, int, int, int], NodeGroup] = {}
        # Node groups are made from any thread: receives from any source make pair groups on their
        # own, and a caller may run collectives from several.
        self._groups_lock = threading.Lock()
        self._sends = SendLedger(store, f"nodecomm/{name}", rank, size, seconds)
        # Receives from any source, one worker per tag: in issue order within a tag, and a receive
        # waiting for one tag's message never holds up another's (a sender may send them in any order).
        self._any_source: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
        self._any_source_lock = threading.Lock()
        self._shut_down = False

    def __repr__(self) -> str:
        return f"NodecommProcessGroup(name={self.nodecomm_name!r}, rank={self._rank}, size={self._size})"

    # -- node groups ---------------------------------------------------------------------------------

    def node_group(self, device_type: str) -> NodeGroup:
        node_group = self._collective_groups.get(device_type)
        if node_group is not None:
            return node_group
        with self._groups_lock:
            node_group = self._collective_groups.get(device_type)
            if node_group is None:
                self._check_open()
                node_group = NodeGroup(
                    f"{self.nodecomm_name}/{device_type}", self._rank, self._size,
                    self._options | self._watched({r: r for r in range(self._size)}), self._joiner(self._rank),
                    ranks=tuple(self._global_ranks), what=f"the process group's {device_type} collectives",
                )  # fmt: skip
                self._collective_groups[device_type] = node_group
        return node_group

    def connected_communicator(self, device_type: str):
        """The Communicator of this device type's node group once it has joined, else None (what the C++
        backend binds its native all-reduce to)."""
        node_group = self._collective_groups.get(device_type)
        return node_group.joined if node_group is not None else None

    def _pair_group(self, device_type: str, source: int, destination: int, tag: int) -> NodeGroup:
        key = (device_type, source, destination, tag)
        with self._groups_lock:
            node_group = self._pair_groups.get(key)
            if node_group is None:
                self._check_open()
                name = f"{self.nodecomm_name}/p2p-{device_type}/{source}-{destination}/{_UNSAFE.sub('_', str(tag))}"
                global_ranks = (self._global_ranks[source], self._global_ranks[destination])
                node_group = NodeGroup(
                    name, 0 if self._rank == source else 1, 2, self._options | self._watched({source: 0, destination: 1}),
                    self._joiner(self._rank), background=True,
                    ranks=global_ranks,
                    what=f"the send from global rank {global_ranks[0]} to global rank {global_ranks[1]} (tag {tag})",
                )  # fmt: skip
                self._pair_groups[key] = node_group
        return node_group

    def _watched(self, member_ranks: dict[int, int]) -> dict[str, object]:
        """connect()'s peer_processes for a node group whose ranks are `member_ranks` (group rank -> member
        rank): its other ranks on this machine. Nothing across nodes (their joiner takes none)."""
        if self._node_names is not None or not self._processes:
            return {}
        machine = self._processes[self._rank][0]
        watched = {
            member: (pid, start) for group_rank, member in member_ranks.items()
            for seen, pid, start in [self._processes[group_rank]]
            if group_rank != self._rank and seen == machine and pid > 0
        }  # fmt: skip
        return {"peer_processes": watched} if watched else {}

    def _joiner(self, rank: int) -> Callable | None:
        """How a node group joins its group: None (nodecomm.connect) on one node; across nodes,
        connect_across_nodes on the group's store, naming this rank's node."""
        if self._node_names is None:
            return None
        from nodecomm.client.hierarchical import connect_across_nodes

        return functools.partial(connect_across_nodes, store=self._store, node=self._node_names[rank])

    def _run(self, tensors: list[torch.Tensor], operation: Callable, result: list, async_op: bool) -> Work:
        device = _device_of(tensors)
        return self.node_group(device.type).run(operation, result, device, async_op)

    # -- collectives ---------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> Work:
        op = reduce_op_type(opts.reduceOp if opts is not None else RedOp.SUM)
        tensor = _one(tensors, "all_reduce")
        if tensor.layout != torch.strided:
            _check_dense(tensors)
        check_reducible(tensor.dtype, op)
        return self._run(tensors, lambda comm: collectives.all_reduce(comm, tensor, op), tensors, _async(opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> Work:
        op = reduce_op_type(opts.reduceOp if opts is not None else RedOp.SUM)
        _check_dense(tensors)
        for tensor in tensors:
            check_reducible(tensor.dtype, op)

        def operation(comm) -> None:
            # One reduction per dtype, over the tensors flattened back to back.
            for dtype in dict.fromkeys(t.dtype for t in tensors):
                members = [t for t in tensors if t.dtype == dtype]
                joined = torch.cat([collectives.flat(t) for t in members])
                collectives.all_reduce(comm, joined, op)
                _copy_into(members, joined.split([t.numel() for t in members]))

        return self._run(tensors, operation, tensors, _async(opts))

    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> Work:
        tensor = _one(tensors, "broadcast")
        root = self._root(opts.rootRank)
        return self._run(tensors, lambda comm: collectives.broadcast(comm, tensor, root), tensors, _async(opts))

    def reduce(self, tensors: list[torch.Tensor], opts=None) -> Work:
        tensor = _one(tensors, "reduce")
        op = reduce_op_type(opts.reduceOp)
        _check_dense(tensors)
        check_reducible(tensor.dtype, op)
        root = self._root(opts.rootRank)
        return self._run(tensors, lambda comm: collectives.reduce(comm, tensor, op, root), tensors, _async(opts))

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None) -> Work:
        tensor = _one(inputs, "all_gather")
        outputs = self._per_rank(_one(output_lists, "all_gather"), "all_gather's output list")
        _like("all_gather's output list", outputs, tensor, "the input")

        def operation(comm) -> None:
            _copy_into(outputs, collectives.gather_rows(comm, tensor))

        return self._run([tensor, *outputs], operation, outputs, _async(opts))

    def all_gather_single(self, output: torch.Tensor, source: torch.Tensor, opts=None) -> Work:
        self._world_times("all_gather_into_tensor", output, "output", source, "input")

        def operation(comm) -> None:
            output.copy_(collectives.gather_rows(comm, source).view(output.shape))

        return self._run([output, source], operation, [output], _async(opts))

    _allgather_base = all_gather_single  # the name before torch 2.12

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None
    ) -> Work:
        """output_lists[r][i] receives rank r's inputs[i]."""
        self._per_rank(output_lists, "all_gather_coalesced's output lists")
        for outputs in output_lists:
            if len(outputs) != len(inputs):
                raise InvalidArgumentError(
                    f"all_gather_coalesced: an output list holds {len(outputs)} tensors for {len(inputs)} inputs"
                )

        def operation(comm) -> None:
            # Every input's bytes back to back, gathered once.
            joined = torch.cat([collectives.flat(t).view(torch.uint8) for t in inputs])
            rows = collectives.gather_rows(comm, joined)
            for row, outputs in zip(rows, output_lists, strict=True):
                offset = 0
                for tensor, output in zip(inputs, outputs, strict=True):
                    nbytes = tensor.numel() * tensor.element_size()
                    output.copy_(row[offset : offset + nbytes].view(tensor.dtype).view(output.shape))
                    offset += nbytes

        received = [t for outputs in output_lists for t in outputs]
        return self._run([*inputs, *received], operation, received, _async(opts))

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None) -> Work:
        def operation(comm) -> None:
            for output, source in zip(outputs, inputs, strict=True):
                output.copy_(collectives.gather_rows(comm, source).view(output.shape))

        return self._run([*outputs, *inputs], operation, outputs, _async(opts))

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # the name before torch 2.12

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts=None) -> Work:
        output = _one(outputs, "reduce_scatter")
        sources = self._per_rank(_one(input_lists, "reduce_scatter"), "reduce_scatter's input list")
        op = reduce_op_type(opts.reduceOp)
        _check_dense([output, *sources])
        check_reducible(output.dtype, op)
        _like("reduce_scatter's input list", sources, output, "the output")

        def operation(comm) -> None:
            stacked = torch.cat([collectives.flat(t) for t in sources])
            collectives.reduce_scatter(comm, output, stacked, op)

        return self._run([output, *sources], operation, outputs, _async(opts))

    def reduce_scatter_single(self, output: torch.Tensor, source: torch.Tensor, opts=None) -> Work:
        op = reduce_op_type(opts.reduceOp if opts is not None else RedOp.SUM)
        _check_dense([output, source])
        self._world_times("reduce_scatter_tensor", source, "input", output, "output")
        check_reducible(output.dtype, op)
        operation = lambda comm: collectives.reduce_scatter(comm, output, source, op)  # noqa: E731
        return self._run([output, source], operation, [output], _async(opts))

    _reduce_scatter_base = reduce_scatter_single  # the name before torch 2.12

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None
    ) -> Work:
        op = reduce_op_type(opts.reduceOp if opts is not None else RedOp.SUM)
        _check_dense([*outputs, *inputs])
        if len(outputs) != len(inputs):
            raise InvalidArgumentError(
                f"reduce_scatter_tensor_coalesced: {len(outputs)} outputs for {len(inputs)} inputs; expected one each"
            )
        for output, source in zip(outputs, inputs, strict=True):
            self._world_times("reduce_scatter_tensor_coalesced", source, "input", output, "output")
            check_reducible(output.dtype, op)

        def operation(comm) -> None:
            for output, source in zip(outputs, inputs, strict=True):
                collectives.reduce_scatter(comm, output, source, op)

        return self._run([*outputs, *inputs], operation, outputs, _async(opts))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # the name before torch 2.12

    def all_to_all_single(
        self,
        output: torch.Tensor,
        source: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts=None,
    ) -> Work:
        def operation(comm) -> None:
            collectives.all_to_all(comm, output, source, list(output_split_sizes), list(input_split_sizes))

        return self._run([output, source], operation, [output], _async(opts))

    alltoall_base = all_to_all_single  # the name before torch 2.12

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None) -> Work:
        self._per_rank(outputs, "all_to_all's output list")
        self._per_rank(inputs, "all_to_all's input list")

        def operation(comm) -> None:
            joined = torch.cat([collectives.flat(t) for t in inputs])
            received = torch.empty(sum(t.numel() for t in outputs), dtype=joined.dtype, device=joined.device)
            collectives.all_to_all(comm, received, joined, [t.numel() for t in outputs], [t.numel() for t in inputs])
            _copy_into(outputs, received.split([t.numel() for t in outputs]))

        return self._run([*outputs, *inputs], operation, outputs, _async(opts))

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None) -> Work:
        tensor = _one(inputs, "gather")
        root = self._root(opts.rootRank)
        outputs = []
        if self._rank == root:
            outputs = self._per_rank(_one(output_lists, "gather"), "gather's output list")
            _like("gather's output list", outputs, tensor, "the input")
        elif output_lists and output_lists[0]:
            raise InvalidArgumentError(f"gather: only the destination rank {root} passes an output list")

        def operation(comm) -> None:
            rows = collectives.gather_rows(comm, tensor)
            if outputs:
                _copy_into(outputs, rows)

        return self._run([tensor, *outputs], operation, outputs, _async(opts))

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts=None) -> Work:
        output = _one(outputs, "scatter")
        root = self._root(opts.rootRank)
        sources = []
        if self._rank == root:
            sources = self._per_rank(_one(input_lists, "scatter"), "scatter's input list")
            _like("scatter's input list", sources, output, "the output")
        elif input_lists and input_lists[0]:
            raise InvalidArgumentError(f"scatter: only the source rank {root} passes an input list")

        def operation(comm) -> None:
            count = output.numel()
            if sources:
                stacked = torch.cat([collectives.flat(t) for t in sources])
            else:
                stacked = torch.empty(count * self._size, dtype=output.dtype, device=output.device)
            collectives.broadcast(comm, stacked, root)
            output.copy_(stacked[self._rank * count : (self._rank + 1) * count].view(output.shape))

        return self._run([output, *sources], operation, outputs, _async(opts))

    def barrier(self, opts=None) -> Work:
        """On the CPU group, or on the CUDA one when no CPU group was made (every rank has made the
        same node groups by now, on the calling thread, at the same collectives; a CPU group joins
        in the background, so whether it has joined yet differs between ranks)."""
        cuda = self._collective_groups.get("cuda")
        cpu = self._collective_groups.get("cpu")
        if cuda is not None and cuda.connected and cpu is None:
            device = cuda.communicator(torch.device("cuda")).device
            return cuda.run(lambda comm: comm.barrier(), [], device, _async(opts))
        return self.node_group("cpu").run(lambda comm: comm.barrier(), [], torch.device("cpu"), _async(opts))

    # -- point to point ------------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], destination: int, tag: int) -> Work:
        tensor = _one(tensors, "send")
        self._peer(destination, "send to")
        node_group = self._pair_group(tensor.device.type, self._rank, destination, tag)
        payload = collectives.flat(tensor)

        def operation(comm) -> None:
            comm.all_gather(payload)

        self._sends.sent(destination, tag)
        return node_group.run(operation, tensors, _device_of(tensors), True)

    def recv(self, tensors: list[torch.Tensor], source: int, tag: int) -> Work:
        tensor = _one(tensors, "recv")
        self._peer(source, "receive from")
        self._sends.taken(source, tag)
        return self._receive(tensor, source, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        """A receive from whichever rank has sent this rank a message with `tag` that no receive
        has taken yet (distributed/sends.py), on that pair's group; the Work's source then names it."""
        tensor = _one(tensors, "recv")
        _device_of(tensors)
        self._check_open()
        done: concurrent.futures.Future = concurrent.futures.Future()
        work = Work(tensors, done=done)
        work.source = -1  # no sender yet, as gloo says until the receive completes
        # CUDA: the receive runs after what the caller's stream holds now, as a named one does;
        # the Work completes once the data is on the device.
        issued = None
        if tensor.is_cuda:
            issued = torch.cuda.Event()
            issued.record(torch.cuda.current_stream(tensor.device))

        def job() -> None:
            try:
                source = self._sends.claim(tag)
                if issued is None:
                    self._receive(tensor, source, tag).synchronize()
                else:
                    with torch.cuda.device(tensor.device), torch.cuda.stream(torch.cuda.Stream(tensor.device)):
                        torch.cuda.current_stream().wait_event(issued)
                        self._receive(tensor, source, tag).synchronize()
                work.source = source
            except BaseException as error:  # noqa: BLE001 (the Work raises it)
                done.set_exception(error)
            else:
                done.set_result(None)

        with self._any_source_lock:
            self._check_open()
            worker = self._any_source.get(tag)
            if worker is None:
                worker = self._any_source[tag] = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix=f"nodecomm-recv-any-{tag}"
                )
            worker.submit(job)
        return work

    def _receive(self, tensor: torch.Tensor, source: int, tag: int) -> Work:
        node_group = self._pair_group(tensor.device.type, source, self._rank, tag)

        def operation(comm) -> None:
            rows = comm.all_gather(torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device))
            tensor.copy_(rows[0].view(tensor.shape))

        work = node_group.run(operation, [tensor], tensor.device, True)
        work.source = source
        return work

    # -- checks --------------------------------------------------------------------------------

    def _root(self, root: int) -> int:
        if not 0 <= root < self._size:
            raise InvalidArgumentError(f"root rank {root} is outside this group's ranks 0..{self._size - 1}")
        return root

    def _peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self._size or peer == self._rank:
            raise InvalidArgumentError(
                f"cannot {what} rank {peer}: expected another rank of this group's 0..{self._size - 1}"
            )

    def _world_times(self, what: str, whole: torch.Tensor, whole_is: str, part: torch.Tensor, part_is: str) -> None:
        """Raise unless `whole` holds world_size times `part`'s elements, of its dtype (an all-gather's
        output and input, a reduce-scatter's input and output)."""
        if whole.numel() != part.numel() * self._size or whole.dtype != part.dtype:
            raise InvalidArgumentError(
                f"{what}: the {whole_is} holds {whole.numel()} {whole.dtype}; expected world_size ({self._size}) "
                f"times the {part_is}'s {part.numel()}, of its dtype {part.dtype}"
            )

    def _per_rank(self, tensors: list[torch.Tensor], what: str) -> list[torch.Tensor]:
        if len(tensors) != self._size:
            raise InvalidArgumentError(f"{what} has {len(tensors)} tensors; expected one per rank ({self._size})")
        return tensors

    # -- teardown ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._shut_down:
            raise InvalidArgumentError(
                f"process group {self.nodecomm_name!r} was shut down (destroy_process_group or abort); create a new one"
            )

    def shutdown(self) -> None:
        """Leave every nodecomm group of this process group (what destroy_process_group calls),
        once the operations under way have finished (each is bounded by the group's timeout)."""
        self._leave(aborting=False)

    def abort(self) -> None:
        """Leave every nodecomm group of this process group now: the operations under way end at
        once on every rank (Communicator.abort), where shutdown() lets them finish."""
        self._leave(aborting=True)

    def _leave(self, aborting: bool) -> None:
        with self._any_source_lock:
            self._shut_down = True
            workers, self._any_source = list(self._any_source.values()), {}
        self._sends.close()  # receives from any source still waiting for a sender end now
        with self._groups_lock:
            node_groups = [*self._pair_groups.values(), *self._collective_groups.values()]
            self._pair_groups, self._collective_groups = {}, {}
        try:
            if aborting:
                for node_group in node_groups:
                    node_group.abort()
            for worker in workers:
                worker.shutdown(wait=True)  # a receive under way is bounded by the group's timeout
            for node_group in node_groups:
                node_group.close()
        finally:
            if self._daemon_lease is not None:
                self._daemon_lease.release()


def _async(opts) -> bool:
    return True if opts is None else bool(getattr(opts, "asyncOp", True))
