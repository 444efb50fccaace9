"""Per-call host time of CPU all-reduces at world 2, back to back (median of 5 runs): dist.all_reduce
on the "nodecomm" group, comm.all_reduce in place, and dist.all_reduce on a gloo group of the same
ranks, in one run. Start one process per rank:
    python .ci/ab-percall.py RANK WORLD STORE_FILE        (rank 0 prints "call bytes us")
NC_BEFORE=1 with an earlier tree's install first on PYTHONPATH runs that tree (the editable
install's finder is dropped so that it cannot shadow it)."""

import os
import statistics
import sys
import time

if os.environ.get("NC_BEFORE"):
    sys.meta_path = [finder for finder in sys.meta_path if "Redirect" not in type(finder).__name__]

import torch  # noqa: E402 (after the finder is dropped)
import torch.distributed as dist  # noqa: E402

import nodecomm  # noqa: E402
import nodecomm.distributed  # noqa: E402


def per_call_us(call, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    rank, world, store_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("nodecomm", rank=rank, world_size=world, store=dist.FileStore(store_path, world))
    gloo = dist.new_group(backend="gloo")
    if rank == 0:
        print("nodecomm from", nodecomm.__file__, file=sys.stderr)
    comm = nodecomm.distributed.communicator()
    for nbytes in (1024, 16384, 262144):
        x = torch.ones(nbytes // 4)
        rows = {
            "dist.all_reduce nodecomm": lambda x=x: dist.all_reduce(x),
            "comm.all_reduce out=x": lambda x=x: comm.all_reduce(x, out=x),
            "dist.all_reduce gloo": lambda x=x: dist.all_reduce(x, group=gloo),
        }
        for name, call in rows.items():
            calls = (2000 if "gloo" in name else 10000) // (4 if nbytes > 16384 else 1)
            call()
            runs = [per_call_us(call, calls) for _ in range(5)]
            if rank == 0:
                print(f"{name:28s} {nbytes:8d} {statistics.median(runs):9.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
