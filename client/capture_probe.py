"""Capture probes: the lossless path an all-reduce size is captured on, timed in CUDA graphs just
before an engine captures it.

A replay runs without the host: a captured call costs what its kernels cost, not their launches,
so eager timings (the daemon's live ones, a fresh daemon's built-in table) can favour another
path than replays do (docs/bench-gpu.md, *Captured sizes*). Engines run every shape they capture
eagerly first, inside their capture phase (vLLM's and SGLang's graph_capture(), which enter
Communicator.capture() through the custom all-reduce slot). The first such call of a size times
each lossless path this rank runs in a graph of a few calls, replayed a few times; the ranks sum
their times with an all-reduce (every rank gets the same bits) and all take the path with the
least, which the size's captured calls then take. Every rank probes the same calls in the same
order, so all capture the same paths.

Another thread of the process may be capturing a graph meanwhile, in torch's default global mode,
which forbids every other thread the calls a probe makes (allocations, waits on events, a copy to
the host): one such call fails and breaks that capture. So the probe's thread runs relaxed, and
its own graphs are captured thread-local: neither capture constrains the other.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import statistics
from collections.abc import Callable, Iterator, Sequence

import torch

from nodecomm import _native
from nodecomm.thresholds import PEER_PATHS, Path

from .dispatch import PATH_CODES, Dispatcher

log = logging.getLogger("nodecomm.client")

# Timed replays of each path's graph, after one that is not timed (it uploads the graph).
REPLAYS = 5
# A rival replaces the table's path only where it is faster by more than this share (noise
# between two equal paths moves nothing).
MARGIN = 0.02


def calls_per_graph(nbytes: int) -> int:
    """Calls in each probe graph: enough that a replay's launch is a small part of it, few at
    sizes whose calls are long (up to about 2 MiB of calls in all)."""
    return max(2, min(16, (2 << 20) // max(nbytes, 1)))


def graph_seconds(run: Callable[[], object], calls: int, device: torch.device) -> float:
    """Per-call seconds of `run` (on `device`'s current stream), captured `calls` times in one
    graph: the median of REPLAYS replays."""
    graph = torch.cuda.CUDAGraph()
    current, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    side.wait_stream(current)
    # capture_begin, not torch.cuda.graph(): that one also collects garbage and empties the cache.
    with torch.cuda.device(device), torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            for _ in range(calls):
                run()
        finally:
            graph.capture_end()
    current.wait_stream(side)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(REPLAYS + 1)]
    with torch.cuda.device(device), torch.cuda.stream(current):
        graph.replay()
        events[0].record()
        for event in events[1:]:
            graph.replay()
            event.record()
    events[-1].synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in itertools.pairwise(events)) / 1e3 / calls


@contextlib.contextmanager
def relaxed_thread() -> Iterator[None]:
    """This thread's calls are not refused while another thread captures a graph (see above)."""
    previous = _native.cuda_exchange_capture_mode(_native.CUDA_CAPTURE_RELAXED)
    try:
        yield
    finally:
        _native.cuda_exchange_capture_mode(previous)


def fastest_path(
    all_reduce: Callable[..., torch.Tensor], like: torch.Tensor, candidates: Sequence[Path], table_path: Path
) -> tuple[Path, list[float]]:
    """The path that captured all-reduces of `like`'s size and dtype should take, agreed by every
    rank, and the ranks' summed per-call seconds of each candidate. `all_reduce(x, out=, path=)`
    is the group's (forced calls are never probed)."""
    x, out = torch.zeros_like(like), torch.empty_like(like)
    calls = calls_per_graph(like.nbytes)
    mine = []
    for path in candidates:

        def run(name: str = path.value) -> None:
            all_reduce(x, out=out, path=name)

        run()  # once eagerly: nothing a path sets up on its first call lands in the graph
        mine.append(graph_seconds(run, calls, like.device))
    # In the call's dtype, which the group reduces (bf16 keeps 3 digits: finer than MARGIN).
    times = torch.tensor([seconds * 1e6 for seconds in mine], dtype=like.dtype, device=like.device)
    summed = [us / 1e6 for us in all_reduce(times, path=candidates[0].value).tolist()]
    best = min(range(len(candidates)), key=summed.__getitem__)
    kept = summed[candidates.index(table_path)]
    return (candidates[best] if summed[best] < kept * (1 - MARGIN) else table_path), summed


def probe_for_capture(
    all_reduce: Callable[..., torch.Tensor], tensor: torch.Tensor, dispatcher: Dispatcher, where: dict
) -> None:
    """Time `tensor`'s size on every lossless path the group runs, in graphs; the size's captured
    calls then take the fastest (native/dispatch.h set_probed), on every rank alike."""
    table_path = dispatcher.table.path_for(tensor.nbytes)
    candidates = [path for path in PEER_PATHS if path in dispatcher.paths]  # the lossless ones
    with relaxed_thread():
        path, summed = fastest_path(all_reduce, tensor, candidates, table_path)
    dispatcher.native.set_probed(tensor.nbytes, PATH_CODES[path])
    log.info(
        "captured size probed",
        extra={
            **where,
            "bytes": tensor.nbytes,
            "path": path.value,
            "table_path": table_path.value,
            "seconds": dict(zip((p.value for p in candidates), summed, strict=True)),
        },
    )


class CapturePhases:
    """Communicator.capture()'s phases, which may nest: a CUDA group's probes are armed while one
    is open (native/dispatch.h arm_probes)."""

    def __init__(self, dispatch: _native.Dispatch, cuda: bool):
        self._dispatch = dispatch
        self._cuda = cuda
        self._depth = 0

    @contextlib.contextmanager
    def phase(self) -> Iterator[None]:
        armed = self._cuda and self._depth == 0
        self._depth += 1
        if armed:
            self._dispatch.arm_probes(True)
        try:
            yield
        finally:
            self._depth -= 1
            if armed:
                self._dispatch.arm_probes(False)
