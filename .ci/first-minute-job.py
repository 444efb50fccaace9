"""A job's first 30 s on one GPU: two ranks (this script run as rank 0 and rank 1) all-reduce
eagerly at the sizes given through their private daemon, until rank 0 has seen 30 s pass; the
ranks stop together (a flag all-reduced every 100 rounds). Prints each rank's calls and its table."""

import sys
import time

import torch

import nodecomm

rank, seconds, sizes = int(sys.argv[1]), float(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")]
with nodecomm.connect(
    "first-minute", rank, 2, device="cuda:0", daemon="private", job="first-minute", timeout=120
) as comm:
    tensors = [torch.ones(n // 4, device="cuda:0") for n in sizes]
    flag = torch.zeros(1, device="cuda:0")
    started, rounds = time.monotonic(), 0
    while True:
        for x in tensors:
            comm.all_reduce(x)
        rounds += 1
        if rounds % 100 == 0:
            flag.fill_(1.0 if rank == 0 and time.monotonic() - started > seconds else 0.0)
            if comm.all_reduce(flag).item() > 0:
                break
    torch.cuda.synchronize()
    print(f"rank {rank}: {rounds} rounds in {time.monotonic() - started:.1f} s; table {comm.thresholds().rows()}")
