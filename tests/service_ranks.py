"""Rank programs of the service path's tests (CPU and CUDA groups), importable by spawned children."""

from __future__ import annotations

import time

import torch

import nodecomm
from ranks import BITS, DTYPES, rank_device, rank_input, reference_sum


def service_cases(rank: int, world_size: int, socket: str, counts: list[int], device: str = "cpu") -> list[str]:
    """The service path against the reference and the peer paths, by bits: staged tensors, tensors
    in service memory (out of place and in place), all_gather and the top-k stage."""
    problems = []
    device = rank_device(rank, device)
    with nodecomm.connect("service", rank, world_size, device=device, socket=socket, timeout=60) as comm:
        buffer = comm.service_buffer(2 * max(counts) * 4 + 128)
        for index, count in enumerate(counts):
            for dtype_name, dtype in DTYPES.items():
                seed = 100 * index + len(dtype_name)
                x = rank_input(rank, count, dtype, seed).to(device)
                expected = reference_sum(world_size, count, dtype, seed).view(BITS[dtype])
                staged = comm.all_reduce(x, path="service")
                shm = comm.all_reduce(x, path="oneshot")
                shared_in = buffer.tensor(count, dtype)
                shared_in.copy_(x)
                shared_out = buffer.tensor(count, dtype, offset_bytes=-(-count * 4 // 64) * 64)
                by_reference = comm.all_reduce(shared_in, out=shared_out, path="service")
                comm.all_reduce(shared_in, out=shared_in, path="service")  # in place
                for name, y in (
                    ("staged", staged),
                    ("oneshot", shm),
                    ("by reference", by_reference),
                    ("in place", shared_in),
                ):
                    got = y.cpu().view(BITS[dtype])
                    if not torch.equal(got, expected):
                        wrong = int((got != expected).sum())
                        problems.append(f"{dtype_name} count={count} service {name}: {wrong} elements differ")
            payload = torch.full((count,), rank, dtype=torch.int32, device=device)
            gathered = comm.all_gather(payload, path="service")
            if not torch.equal(gathered, comm.all_gather(payload)):
                problems.append(f"all_gather count={count}: service differs from shm")
    return problems


def service_in_order(rank: int, world_size: int, socket: str, steps: int, device: str = "cpu") -> list[list[float]]:
    """Queue `steps` in-place all-reduces interleaved with all-gathers that snapshot the value, all
    asynchronous, then wait once at the end: the snapshots show the order the daemon ran them in."""
    device = rank_device(rank, device)
    with nodecomm.connect("order", rank, world_size, device=device, socket=socket, timeout=60) as comm:
        buffer = comm.service_buffer(64 * (steps + 1))
        value = buffer.tensor(1, torch.float32)
        value.fill_(rank + 1)
        snapshots = [buffer.tensor(world_size, torch.float32, offset_bytes=64 * (k + 1)) for k in range(steps)]
        works = []
        for k in range(steps):
            works.append(comm.all_reduce(value, out=value, path="service", async_op=True))
            works.append(comm.all_gather(value, out=snapshots[k].view(world_size, 1), path="service", async_op=True))
        pending_before_wait = sum(not w.done() for w in works)
        for work in works:
            work.wait()
        assert pending_before_wait > 0 or steps < 4, "every submit had finished before the first wait"
        return [s.tolist() for s in snapshots]


def service_mismatch(rank: int, world_size: int, socket: str, device: str = "cpu") -> dict:
    """Collective 0 disagrees on count; every rank gets the same error; collective 1 runs."""
    seen = {}
    device = rank_device(rank, device)
    with nodecomm.connect("svc-mismatch", rank, world_size, device=device, socket=socket, timeout=60) as comm:
        try:
            comm.all_reduce(torch.ones(8 + 8 * (rank == 1), device=device), path="service")
            seen["error"] = "no error"
        except nodecomm.NodecommError as error:
            seen["error"] = f"{type(error).__name__}: {error}"
        seen["after"] = comm.all_reduce(torch.ones(4, device=device), path="service").tolist()
    return seen


def service_over_quota(rank: int, world_size: int, socket: str, depth: int, report, commands) -> dict:
    """Rank 0 queues depth + 1 submits while rank 1 holds back: the last is past the queue."""
    seen = {}
    with nodecomm.connect("svc-quota", rank, world_size, socket=socket, timeout=60) as comm:
        x = torch.ones(16)
        if rank == 0:
            works = [comm.all_reduce(x, path="service", async_op=True) for _ in range(depth + 1)]
            try:
                works[-1].wait()
                seen["last"] = "no error"
            except nodecomm.NodecommError as error:
                seen["last"] = f"{type(error).__name__}: {error}"
            report.put("queued")
            for work in works[:-1]:
                work.wait()
        else:
            assert commands.get(timeout=60) == "go"
            for _ in range(depth):
                comm.all_reduce(x, path="service")
            try:
                comm.all_reduce(x, path="service")
                seen["last"] = "no error"
            except nodecomm.NodecommError as error:
                seen["last"] = f"{type(error).__name__}: {error}"
        seen["after"] = comm.all_reduce(x, path="service").tolist()
    return seen


def service_until_peer_dies(
    rank: int, world_size: int, socket: str, report, device: str = "cpu"
) -> tuple[str, str, float]:
    """Rank 0 queues service all-reduces that rank 1 never submits, then waits on them; rank 1 is
    killed by the test meanwhile."""
    device = rank_device(rank, device)
    with nodecomm.connect("svc-kill", rank, world_size, device=device, socket=socket, timeout=60) as comm:
        comm.all_reduce(torch.ones(4, device=device), path="service")
        if rank == 1:
            report.put(("ready", rank))
            time.sleep(120)  # killed here by the test
            return "not killed", "", 0.0
        works = [comm.all_reduce(torch.ones(1024, device=device), path="service", async_op=True) for _ in range(3)]
        report.put(("ready", rank))
        try:
            for work in works:
                work.wait()
        except nodecomm.NodecommError as error:
            return type(error).__name__, str(error), time.time()
        return "no error", "", time.time()


def service_topk_cases(
    rank: int, world_size: int, socket: str, rows_list: list[int], topk: int, device: str = "cpu"
) -> list[str]:
    """The top-k stage through the daemon gives the same owner tables, bit for bit, as the slabs."""
    problems = []
    device = rank_device(rank, device)
    with nodecomm.connect("svc-topk", rank, world_size, device=device, socket=socket, timeout=60) as comm:
        exchange = comm.topk_exchange(max(rows_list), topk)
        for stage, rows in enumerate(rows_list):
            generator = torch.Generator().manual_seed(1000 * stage + rank)
            idx = torch.randint(-(2**31), 2**31 - 1, (rows, topk), dtype=torch.int32, generator=generator)
            bits = torch.randint(-(2**31), 2**31 - 1, (rows, topk), dtype=torch.int32, generator=generator)
            idx, scores = idx.to(device), bits.view(torch.float32).to(device)  # NaN payloads, -0.0: as bits
            slab_idx, slab_scores = exchange.stage(idx, scores)
            svc_idx, svc_scores = exchange.stage(idx, scores, path="service")
            if not (
                torch.equal(slab_idx, svc_idx)
                and torch.equal(slab_scores.view(torch.int32), svc_scores.view(torch.int32))
            ):
                problems.append(f"rows={rows}: the service owner table differs from the slab's")
    return problems


def service_by_table(rank: int, world_size: int, socket: str) -> dict:
    """A group whose table sends 4 KiB and up to the service path: the dispatcher picks it."""
    with nodecomm.connect(
        "svc-table", rank, world_size, socket=socket, timeout=60, thresholds={"service_min_bytes": "4KiB"}
    ) as comm:
        rows = [(low, high, path.value) for low, high, path in comm.thresholds().rows()]
        small, large = torch.full((256,), rank + 1.0), torch.full((4096,), rank + 1.0)  # 1 KiB, 16 KiB
        return {
            "rows": rows,
            "small": comm.all_reduce(small).unique().tolist(),
            "large": comm.all_reduce(large).unique().tolist(),
        }
