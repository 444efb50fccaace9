"""Rank programs of the load test (importable by spawned children): steady groups that all-reduce
without pause, and churning groups that form, work and leave over and over. Every result is
checked exactly; a wrong one counts as corrupted."""

from __future__ import annotations

import os
import time

import torch

import nodecomm

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def steady(rank: int, world_size: int, socket: str, group: str, seconds: float) -> dict:
    """All-reduce sizes from 1 KiB to 256 KiB, round robin, until `seconds` have passed (the
    ranks agree on when to stop through the collective itself: rank 0's decision is summed in)."""
    latencies, corrupted, sizes = [], 0, [256, 4096, 65536]
    with nodecomm.connect(group, rank, world_size, socket=socket, timeout=60) as comm:
        started = time.monotonic()
        step = 0
        while True:
            count = sizes[step % len(sizes)]
            x = torch.full((count,), float(rank + 1))
            x[0] = 1.0 if rank == 0 and time.monotonic() - started > seconds else 0.0
            begun = time.perf_counter()
            y = comm.all_reduce(x, path="service" if step % 7 == 3 else None)
            latencies.append(time.perf_counter() - begun)
            corrupted += int((y[1:] != world_size * (world_size + 1) / 2).sum())
            step += 1
            if y[0] >= 1.0:
                break
    return {
        "ops": step,
        "seconds": time.monotonic() - started,
        "p99_op": _percentile(latencies, 0.99),
        "corrupted": corrupted,
    }


def churn(rank: int, world_size: int, socket: str, prefix: str, seconds: float) -> dict:
    """Form a group, all-reduce, take a service buffer and a top-k exchange, leave; again and
    again under a fresh name each round, until `seconds` have passed."""
    joins, join_latencies, corrupted, rounds = 0, [], 0, 0
    started = time.monotonic()
    while True:
        begun = time.perf_counter()
        with nodecomm.connect(f"{prefix}-{rounds}", rank, world_size, socket=socket, timeout=60) as comm:
            join_latencies.append(time.perf_counter() - begun)
            joins += 1
            y = comm.all_reduce(torch.full((1024,), float(rank + 1)))
            corrupted += int((y != world_size * (world_size + 1) / 2).sum())
            buffer = comm.service_buffer(1 << 16)
            z = comm.all_reduce(buffer.tensor(512, torch.float32).fill_(1.0), path="service")
            corrupted += int((z != world_size).sum())
            buffer.free()
            exchange = comm.topk_exchange(16, 4)
            idx, _ = exchange.stage(torch.full((16, 4), rank, dtype=torch.int32), torch.zeros(16, 4))
            corrupted += int((idx != torch.arange(world_size, dtype=torch.int32).view(1, -1, 1)).sum())
            # Every rank must agree whether to go on, or one would wait alone at the next Join.
            stop = comm.all_reduce(torch.tensor([float(time.monotonic() - started > seconds)]))
        rounds += 1
        if stop.item() > 0:
            break
    return {
        "joins": joins,
        "seconds": time.monotonic() - started,
        "p99_join": _percentile(join_latencies, 0.99),
        "corrupted": corrupted,
    }
