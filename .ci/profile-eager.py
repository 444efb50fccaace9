"""One eager all-reduce call, repeated, for a profiler: `python .ci/profile-eager.py RANK WORLD
STORE_FILE ROW CALLS [cpu|cuda]` with ROW `comm` (comm.all_reduce(x, out=x)), `dist`
(dist.all_reduce(x) on the "nodecomm" group), `async` (dist.all_reduce(x, async_op=True).wait())
or `slot` (vLLM's call of NodecommAllreduce: should_custom_ar, then custom_all_reduce; CUDA), 16
KiB of float32; CUDA ranks share GPU 0 (under
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
    calls_of = {
        "comm": lambda: comm.all_reduce(x, out=x),
        "dist": lambda: dist.all_reduce(x),
        "async": lambda: dist.all_reduce(x, async_op=True).wait(),
    }
    if row == "slot":  # as vLLM's CudaCommunicator.all_reduce calls its custom all-reduce slot
        from nodecomm.integrations.custom_all_reduce import NodecommAllreduce

        socket = nodecomm.distributed.daemon(device=device).socket
        slot = NodecommAllreduce(dist.group.WORLD, device, max_size=1 << 20, socket=socket)
        assert not slot.disabled, slot.disabled_reason
        calls_of["slot"] = lambda: not slot.disabled and slot.should_custom_ar(x) and slot.custom_all_reduce(x)
    call = calls_of[row]
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
