"""Per-call host time of all-reduces at world 2, back to back (median of 5 runs), in one run.
CPU: dist.all_reduce on the "nodecomm" group (synchronous, asynchronous and waited, and torch's
functional all_reduce waited), comm.all_reduce in place, the native lane's call
beneath it (what the Communicator wraps), dist.all_reduce on a gloo group of the same ranks, and
on torch's "fake" backend, which moves nothing and returns a completed Work: torch.distributed's
own cost per call, which every backend pays (CPU and CUDA alike).
CUDA (ranks sharing a GPU under MPS have no NCCL): the same nodecomm rows and, each timed alone,
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


def per_call_us(call, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def rows_for(x: torch.Tensor, comm, gloo, fake) -> dict:
    import torch.distributed._functional_collectives as funcol

    from nodecomm.client.dtypes import DTYPE_CODES

    rows = {
        "dist.all_reduce nodecomm": lambda: dist.all_reduce(x),
        "async_op=True .wait()": lambda: dist.all_reduce(x, async_op=True).wait(),
        "funcol.all_reduce waited": lambda: funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD)),
        "comm.all_reduce out=x": lambda: comm.all_reduce(x, out=x),
    }
    if fake is not None:
        rows["dist.all_reduce fake"] = lambda: dist.all_reduce(x, group=fake)
        rows["async_op=True .wait() fake"] = lambda: dist.all_reduce(x, group=fake, async_op=True).wait()
        rows["funcol waited fake"] = lambda: funcol.wait_tensor(funcol.all_reduce(x, "sum", fake))
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
    scale = 4 if os.environ.get("NC_QUICK") else 1  # a quarter of the calls, for a short device call
    for nbytes in (1024, 16384, 262144):
        x = torch.ones(nbytes // 4, device=device)
        for name, call in rows_for(x, comm, gloo, fake).items():
            calls = (2000 if "gloo" in name else 10000) // (4 if nbytes > 16384 else 1) // scale
            call()
            runs = [per_call_us(call, calls) for _ in range(5)]
            if cuda:
                torch.cuda.synchronize()
            if rank == 0:
                print(f"{name:28s} {nbytes:8d} {statistics.median(runs):9.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
