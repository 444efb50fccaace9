"""Per-call host time of all-reduces at world 2, back to back (median of 15 rounds, the rows taking
turns in each), in one run, then issue 59's bounds, each from its call and its sum timed in
pairs of runs of 100 calls back to back: the median of the pairs' margins.
CPU: dist.all_reduce on the "nodecomm" group (synchronous, asynchronous and waited, and torch's
functional all_reduce waited), comm.all_reduce in place, the native lane's call
beneath it (what the Communicator wraps), dist.all_reduce on a gloo group of the same ranks, and
on torch's "fake" backend, which moves nothing and returns a completed Work: torch.distributed's
own cost per call, which every backend pays (CPU and CUDA alike), and, as rows of their own, the
fake backend's calls each followed by comm.all_reduce in the same iteration: the sums issue 59
bounds the nodecomm rows by.
CUDA (ranks sharing a GPU under MPS have no NCCL): the same nodecomm rows, the vLLM slot's call
(NodecommAllreduce as vLLM's CudaCommunicator calls it) and, each timed alone,
the stream lookups, an event record (what the bench adds per call) and one torch kernel
(x.mul_(1)). A launch queued behind kernels that have not run waits for one, so a row cheaper
than a call's GPU time shows that. Start one process per rank:
    python .ci/ab-percall.py RANK WORLD STORE_FILE [cpu|cuda]   (rank 0 prints "call bytes us")
NC_BEFORE=1 with an earlier tree's install first on PYTHONPATH runs that tree (the editable
install's finder is dropped so that it cannot shadow it), without the rows it lacks. NC_QUICK=1
makes a quarter of the calls."""

import os
import statistics
import sys
import time

if os.environ.get("NC_BEFORE"):
    sys.meta_path = [finder for finder in sys.meta_path if "Redirect" not in type(finder).__name__]

import torch  # noqa: E402 (after the finder is dropped)
import torch.distributed as dist  # noqa: E402
import torch.testing._internal.distributed.fake_pg  # noqa: E402, F401 (registers the "fake" backend)

import nodecomm  # noqa: E402
import nodecomm.distributed  # noqa: E402

# CUDA calls are timed in runs of this many, the GPU drained between runs (not timed): a launch
# queue that fills (about a thousand launches) makes a call wait for the GPU, and the time
# measured is then the kernels', not the host's.
CUDA_RUN = 100


def run_us(call, count: int, cuda: bool) -> float:
    """The host time of `count` calls back to back, in us per call; the GPU drained after, not timed."""
    start = time.perf_counter()
    for _ in range(count):
        call()
    took = time.perf_counter() - start
    if cuda:
        torch.cuda.synchronize()
    return took / count * 1e6


def per_call_us(call, calls: int, cuda: bool) -> float:
    dist.barrier()
    if not cuda:
        return run_us(call, calls, cuda)
    runs = [min(CUDA_RUN, calls - done) for done in range(0, calls, CUDA_RUN)]
    return sum(run_us(call, count, cuda) * count for count in runs) / calls


def margins_us(call, total, calls: int, cuda: bool) -> list[float]:
    """call - (total + 1 us), per pair of runs of PAIR_RUN calls each, the two runs back to back and
    taking turns at going first: a slow stretch of the host lasts longer than a pair, so it moves
    both runs of one pair alike and shows as an outlier among the pairs, not as a shifted median."""
    dist.barrier()
    margins = []
    for pair in range(max(PAIRS, calls // PAIR_RUN)):
        first, second = (call, total) if pair % 2 == 0 else (total, call)
        a, b = run_us(first, PAIR_RUN, cuda), run_us(second, PAIR_RUN, cuda)
        margins.append((a - b if pair % 2 == 0 else b - a) - 1.0)
    return margins


ROUNDS = 15
PAIR_RUN = 100  # calls per run of a bound's pair
PAIRS = 8  # pairs per round at least: 120 at every size (30 at 256 KiB left its median to chance)

# Issue 59's bounds: each call, at most its sum + 1 us (the fake backend's call and comm.all_reduce
# timed in one row; the slot's call against comm.all_reduce into a new tensor, as the slot returns).
BOUNDS = {
    "dist.all_reduce nodecomm": "fake dist + comm",
    "async_op=True .wait()": "fake async + comm",
    "funcol.all_reduce waited": "fake funcol + comm",
    "vLLM slot call": "comm.all_reduce new out",
}


def print_bounds(margins: dict[str, list[float]], runs: dict[str, list[float]], nbytes: int) -> None:
    """Each bound's margin, call - (sum + 1 us), as the median of its pairs' (margins_us), with how
    many pairs were under."""
    for call, pairs in margins.items():
        under = sum(m <= 0 for m in pairs)
        print(f"bound {call:26s} {nbytes:8d} {statistics.median(pairs):+9.2f}  under in {under}/{len(pairs)}")
    kernel = "x.mul_(1) (one torch kernel)"
    if kernel in runs:
        ratios = [a / b for a, b in zip(runs["comm.all_reduce out=x"], runs[kernel], strict=True)]
        print(f"bound comm / one kernel           {nbytes:8d} {statistics.median(ratios):9.2f}x (at most 1.30x)")


def rows_for(x: torch.Tensor, comm, gloo, fake, slot) -> dict:
    import torch.distributed._functional_collectives as funcol

    from nodecomm.client.dtypes import DTYPE_CODES

    rows = {
        "dist.all_reduce nodecomm": lambda: dist.all_reduce(x),
        "async_op=True .wait()": lambda: dist.all_reduce(x, async_op=True).wait(),
        "funcol.all_reduce waited": lambda: funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD)),
        "comm.all_reduce out=x": lambda: comm.all_reduce(x, out=x),
        "comm.all_reduce new out": lambda: comm.all_reduce(x),  # what the slot returns: a new tensor
    }
    # As vLLM's CudaCommunicator.all_reduce calls its custom all-reduce slot; not at sizes its table
    # leaves to the engine's NCCL (the slot's Communicator refuses those).
    if slot is not None and slot.should_custom_ar(x):
        rows["vLLM slot call"] = lambda: not slot.disabled and slot.should_custom_ar(x) and slot.custom_all_reduce(x)
        # Its parts, and its group's Communicator called as above: where the slot's time goes.
        rows["slot should_custom_ar"] = lambda: slot.should_custom_ar(x)
        rows["slot custom_all_reduce"] = lambda: slot.custom_all_reduce(x)
        rows["slot's comm new out"] = lambda: slot.comm.all_reduce(x)
    # The backends' own allreduce, with torch.distributed's front end (its dispatcher op) left out.
    opts = dist.AllreduceOptions()
    nodecomm_backend = dist.group.WORLD._get_backend(x.device)
    rows["backend.allreduce nodecomm"] = lambda: nodecomm_backend.allreduce([x], opts).wait()
    if fake is not None:
        fake_backend = fake._get_backend(x.device)
        rows["backend.allreduce fake"] = lambda: fake_backend.allreduce([x], opts).wait()
        rows["dist.all_reduce fake"] = lambda: dist.all_reduce(x, group=fake)
        rows["async_op=True .wait() fake"] = lambda: dist.all_reduce(x, group=fake, async_op=True).wait()
        rows["funcol waited fake"] = lambda: funcol.wait_tensor(funcol.all_reduce(x, "sum", fake))
        # The bounds' sums (the fake backend's call + comm.all_reduce) as one row: the two in one
        # iteration, where a call amid torch's front end costs what it does there, not in a tight
        # loop of its own (on the CPU, where ranks meet, the peers' skew grows with the work between).
        rows["fake dist + comm"] = lambda: (dist.all_reduce(x, group=fake), comm.all_reduce(x, out=x))
        rows["fake async + comm"] = lambda: (
            dist.all_reduce(x, group=fake, async_op=True).wait(),
            comm.all_reduce(x, out=x),
        )
        rows["fake funcol + comm"] = lambda: (
            funcol.wait_tensor(funcol.all_reduce(x, "sum", fake)),
            comm.all_reduce(x, out=x),
        )
    if hasattr(comm, "_lane"):  # trees from before the native hot path have no lane
        lane, stream = comm._lane, comm._transport.stream()
        args = (x.data_ptr(), x.data_ptr(), x.numel(), DTYPE_CODES[x.dtype], 0, -1, stream)
        rows["native lane call"] = lambda: lane.all_reduce(*args)
    if not x.is_cuda:
        return rows | {"dist.all_reduce gloo": lambda: dist.all_reduce(x, group=gloo)}
    index, event = x.device.index, torch.cuda.Event(enable_timing=True)
    return rows | {
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(x.device).cuda_stream,
        "raw current stream": lambda: torch._C._cuda_getCurrentRawStream(index),
        "event record": lambda: event.record(),
        "x.mul_(1) (one torch kernel)": lambda: x.mul_(1),
    }


def main() -> None:
    rank, world, store_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    cuda = len(sys.argv) > 4 and sys.argv[4] == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    store = dist.FileStore(store_path, world)
    if cuda:
        torch.cuda.set_device(device)
    bound = {"device_id": device} if cuda else {}
    dist.init_process_group("nodecomm", rank=rank, world_size=world, store=store, **bound)
    gloo = dist.new_group(backend="gloo")
    try:  # the same on every rank: a torch whose fake backend cannot serve here skips the row
        fake = dist.new_group(backend="fake")
    except Exception as error:
        print("no fake backend row:", error, file=sys.stderr)
        fake = None
    if rank == 0:
        print("nodecomm from", nodecomm.__file__, file=sys.stderr)
    comm = nodecomm.distributed.communicator(device=device)
    slot = None
    if cuda:  # the engines' slot class, on the job's daemon (its own group, as an engine's)
        from nodecomm.integrations.custom_all_reduce import NodecommAllreduce

        socket = nodecomm.distributed.daemon(device=device).socket
        slot = NodecommAllreduce(dist.group.WORLD, device, max_size=1 << 20, socket=socket)
        assert not slot.disabled, slot.disabled_reason
    scale = 4 if os.environ.get("NC_QUICK") else 1  # a quarter of the calls, for a short device call
    for nbytes in (1024, 16384, 262144):
        x = torch.ones(nbytes // 4, device=device)
        rows = rows_for(x, comm, gloo, fake, slot)
        runs: dict[str, list[float]] = {name: [] for name in rows}
        for call in rows.values():
            call()
        # The rows take turns within each round, in reverse order every other round: a host that
        # slows down for a while slows every row alike, and no row always runs first.
        calls = 10000 // (4 if nbytes > 16384 else 1) // scale // 3
        for turn in range(ROUNDS):
            for name, call in rows.items() if turn % 2 == 0 else reversed(rows.items()):
                runs[name].append(per_call_us(call, calls // 5 if "gloo" in name else calls, cuda))
        # Each bound's call and its sum again, in alternating runs: the margins printed.
        margins = {call: [] for call, total in BOUNDS.items() if call in rows and total in rows}
        for _ in range(ROUNDS):
            for call in margins:
                margins[call] += margins_us(rows[call], rows[BOUNDS[call]], calls, cuda)
        if rank == 0:
            for name, times in runs.items():
                print(f"{name:28s} {nbytes:8d} {statistics.median(times):9.2f}")
            print_bounds(margins, runs, nbytes)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
