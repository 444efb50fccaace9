"""NodeGroup: one nodecomm group behind a process group, joined on first use, its operations in call order.

A process group has a node group per device type for its collectives, and one per (source, destination,
tag) for sends and receives. Where each operation runs:
- CUDA collectives are enqueued on the caller's current stream, on the calling thread, like
  `comm.all_reduce` (so they can be captured in a CUDA graph);
- CPU collectives run on the calling thread, unless asked to run asynchronously: those go to the
  node group's worker thread, and any operation issued behind them queues there too, so order holds;
- sends and receives always run on their node group's worker (on CUDA, on the node group's own stream, after
  the caller's stream): a rank that sends before it receives must not wait for its peer there.
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
from collections.abc import Callable, Mapping

import torch

from nodecomm.errors import InvalidArgumentError, NodecommError

from .work import Work

Operation = Callable[["Communicator"], None]  # noqa: F821 (nodecomm.client.Communicator)


class NodeGroup:
    def __init__(
        self,
        group: str,
        rank: int,
        world_size: int,
        connect_options: Mapping[str, object],
        joiner: Callable[..., object] | None = None,
        *,
        background: bool = False,
        ranks: tuple[int, ...] = (),
        what: str = "",
    ):
        self.group = group
        # The process group's global ranks by node-group rank, and what the node group carries: what its join's
        # errors say, whose own ranks (a pair's 0 and 1) mean nothing to the job.
        self._ranks, self._what = ranks, what
        self.rank = rank
        self.world_size = world_size
        self._connect_options = dict(connect_options)
        self._joiner = joiner  # nodecomm.connect unless the group spans nodes
        self._background = background
        self._comm = None
        self._joining = threading.Lock()
        self._lock = threading.Lock()  # guards the fields below
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending = 0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._closed = False

    @property
    def connected(self) -> bool:
        return self._comm is not None

    @property
    def joined(self):
        """The Communicator, once the group is joined (None before)."""
        return self._comm

    def communicator(self, device: torch.device):
        """The node group's Communicator, joining its group on the first call (every rank of the node group
        must make that call: it is the group's Join)."""
        comm = self._comm
        if comm is not None:
            return comm
        with self._joining:
            if self._comm is None:
                if self._closed:
                    raise InvalidArgumentError("this process group was shut down", group=self.group, rank=self.rank)
                import nodecomm

                target = "cpu" if device.type == "cpu" else f"cuda:{device.index}"
                join = self._joiner or nodecomm.connect
                try:
                    self._comm = join(self.group, self.rank, self.world_size, device=target, **self._connect_options)
                except NodecommError as error:
                    raise self._said_of_the_job(error) from None
            return self._comm

    def _global(self, group_rank: str) -> int | str:
        """The global rank of a node-group rank written in a message (left as written where it is none)."""
        index = int(group_rank)
        return self._ranks[index] if index < len(self._ranks) else group_rank

    def _said_of_the_job(self, error: NodecommError) -> NodecommError:
        """A join's error in the job's words: its global ranks for the node group's, and what
        it carries (its own group name and ranks follow, for the daemon's logs)."""
        if not self._ranks or self._joiner is not None:
            return error  # across nodes the joins are per node, in the node's own ranks
        detail = re.sub(
            r"\b(ranks?) \[([\d, ]*)\]",
            lambda m: f"global {m.group(1)} {[self._global(r) for r in m.group(2).split(',') if r.strip()]}",
            error.detail,
        )
        detail = re.sub(r"\brank (\d+) waited", lambda m: f"global rank {self._global(m.group(1))} waited", detail)
        said = type(error)(f"{self._what}: {detail} (nodecomm group {self.group!r}, rank {self.rank})")
        said.group, said.rank = error.group, error.rank
        return said

    def run(self, operation: Operation, result: list[torch.Tensor], device: torch.device, async_op: bool) -> Work:
        """Run `operation(comm)`; the Work completes with `result` (the operation's outputs)."""
        cuda = device.type == "cuda"
        if cuda and not self._background:
            operation(self.communicator(device))
            if not async_op:
                # Complete as seen from the current stream, which is all a synchronous caller
                # waits for (looking the stream up costs more than the rest of this method).
                return Work(result)
            stream = torch.cuda.current_stream(device)
            event = torch.cuda.Event()
            event.record(stream)
            return Work(result, stream=stream, event=event)
        # Only this thread adds pending work, so reading the count without the lock is safe: a
        # stale non-zero only sends the operation to the worker, behind what is queued there.
        if not self._background and not async_op and self._pending == 0:
            operation(self.communicator(device))
            return Work(result)
        if cuda:
            work = self._submit_on_stream(operation, result, device)
        else:
            work = Work(result, done=self._submit(lambda: operation(self.communicator(device))))
        if not async_op:
            work.wait()
        return work

    def _submit(self, job: Callable[[], None]) -> concurrent.futures.Future:
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("this process group was shut down", group=self.group, rank=self.rank)
            if self._worker is None:
                self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"nodecomm-{self.group}")
            self._pending += 1
            future = self._worker.submit(job)
        future.add_done_callback(self._finished)
        return future

    def _finished(self, _: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending -= 1

    def _submit_on_stream(self, operation: Operation, result: list[torch.Tensor], device: torch.device) -> Work:
        """CUDA work on the worker: on the node group's stream, after what the caller's stream holds."""
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        for tensor in result:
            tensor.record_stream(stream)  # the caching allocator must not reuse it meanwhile
        done = torch.cuda.Event()

        def job() -> None:
            # Joining runs kernels too (the peer self-test): on this node group's stream as well, so that
            # no two node groups' kernels queue behind each other on one stream in different orders on
            # different ranks (each would wait for the other's peer).
            with torch.cuda.stream(stream):
                comm = self.communicator(device)
                stream.wait_event(ready)
                operation(comm)
                done.record(stream)

        return Work(result, done=self._submit(job), stream=stream, event=done)

    def abort(self) -> None:
        """End the group now for every rank (Communicator.abort), so that the operation under way
        and those queued end at once, then close."""
        comm = self._comm
        if comm is not None:
            comm.abort()
        self.close()

    def close(self) -> None:
        """Let queued operations finish (each is bounded by the operation timeout), then leave."""
        with self._lock:
            self._closed = True
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)
        with self._joining:
            comm, self._comm = self._comm, None
        if comm is not None:
            comm.close()
