"""One eager all-reduce call, repeated, for a profiler: `python .ci/profile-eager.py RANK WORLD
STORE_FILE ROW CALLS [cpu|cuda]` with ROW `comm` (comm.all_reduce(x, out=x)) or `dist`
(dist.all_reduce(x) on the "nodecomm" group), 16 KiB of float32; CUDA ranks share GPU 0 (under
MPS on the device). Every rank makes the same calls; .ci/device-profile.sh runs rank 0 under
py-spy. Prints the calls' host time per call. NC_BEFORE as in ab-percall.py."""

import os
import sys
import time

if os.environ.get("NC_BEFORE"):
    sys.meta_path = [finder for finder in sys.meta_path if "Redirect" not in type(finder).__name__]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import nodecomm.distributed  # noqa: E402


def main() -> None:
    rank, world, store_path, row, calls = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    cuda = len(sys.argv) <= 6 or sys.argv[6] == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nodecomm", rank=rank, world_size=world, store=dist.FileStore(store_path, world))
    comm = nodecomm.distributed.communicator(device=device)
    x = torch.ones(4096, device=device)
    call = (lambda: comm.all_reduce(x, out=x)) if row == "comm" else (lambda: dist.all_reduce(x))
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(200):
        call()
    synchronize()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(calls):
        call()
    took = time.perf_counter() - started
    synchronize()
    dist.barrier()
    print(f"rank {rank} {row}: {took / calls * 1e6:.2f} us per call (host, {calls} calls)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
