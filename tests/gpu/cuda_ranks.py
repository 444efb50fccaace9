"""Rank programs for the CUDA tests: each joins a CUDA group through the daemon as one process.
Ranks share the GPU where there is one, and take one GPU each where there are several."""

from __future__ import annotations

import time

import torch

import nodecomm
from nodecomm import _native
from ranks import BITS, DTYPES, rank_input, reference_sum

PATHS = ("oneshot", "twoshot", "dma")


def device_for(rank: int) -> str:
    return f"cuda:{rank % torch.cuda.device_count()}"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(BITS[a.dtype]), b.cpu().view(BITS[b.dtype]))


def exact_everywhere(rank: int, world_size: int, socket: str, cases: list[tuple[str, int]], delayed_rank: int) -> list:
    """Every case through every path, eager and inside a replayed CUDA graph, against the fp32
    rank-order reference and against a CPU group's shm result; returns the problems found."""
    device = device_for(rank)
    torch.cuda.set_device(device)
    problems = []
    with (
        nodecomm.connect("exact", rank, world_size, device=device, socket=socket, timeout=120) as comm,
        nodecomm.connect("exact-shm", rank, world_size, socket=socket, timeout=120) as host,
    ):
        for seed, (dtype_name, count) in enumerate(cases):
            dtype = DTYPES[dtype_name]
            x_host = rank_input(rank, count, dtype, seed)
            expected = reference_sum(world_size, count, dtype, seed)
            if not _same_bits(host.all_reduce(x_host), expected):
                problems.append(f"shm {dtype_name} count={count} differs from the reference")
            x = x_host.to(device)
            results = {path: comm.all_reduce(x, path=path) for path in (*PATHS, None)}
            inplace = x.clone()
            comm.all_reduce(inplace, out=inplace, path="dma")
            results["dma in place"] = inplace
            for path, y in results.items():
                if not _same_bits(y, expected):
                    wrong = int((y.cpu().view(BITS[dtype]) != expected.view(BITS[dtype])).sum())
                    problems.append(f"{path} {dtype_name} count={count}: {wrong} elements differ")
            if not _same_bits(x, x_host):
                problems.append(f"{dtype_name} count={count}: the input was modified")

        # Eight launches back to back, no host synchronisation, cycling the paths: slots alternate
        # and the copy paths' fixed slots are fenced off from the kernels' by barriers.
        count, dtype = 40_003, torch.bfloat16
        inputs = [rank_input(rank, count, dtype, 100 + k).to(device) for k in range(8)]
        expected = [reference_sum(world_size, count, dtype, 100 + k) for k in range(8)]
        outputs = [comm.all_reduce(inputs[k], path=PATHS[k % 3]) for k in range(8)]
        for k in range(8):
            if not _same_bits(outputs[k], expected[k]):
                problems.append(f"back-to-back launch {k} ({PATHS[k % 3]}) differs")

        # A graph captured once (one rank sleeps inside it), replayed 8 times back to back; each
        # replay's outputs are copied out on the stream and checked after one synchronisation.
        static_in = torch.empty_like(inputs[0])
        static_out = {path: torch.empty_like(inputs[0]) for path in PATHS}
        graph = torch.cuda.CUDAGraph()
        capture_stream = torch.cuda.Stream()
        with torch.cuda.stream(capture_stream), torch.cuda.graph(graph, stream=capture_stream):
            if rank == delayed_rank:
                torch.cuda._sleep(20_000_000)  # ~10 ms of GPU cycles, inside the graph
            for path, out in static_out.items():
                comm.all_reduce(static_in, out=out, path=path)
        history = [{p: torch.empty_like(o) for p, o in static_out.items()} for _ in range(8)]
        for k in range(8):
            static_in.copy_(inputs[k])
            graph.replay()
            for path, out in static_out.items():
                history[k][path].copy_(out)
        torch.cuda.synchronize()
        for k in range(8):
            for path, got in history[k].items():
                if not _same_bits(got, expected[k]):
                    problems.append(f"graph replay {k} {path} differs")

        gathered = comm.all_gather(torch.full((5,), rank, dtype=torch.int32, device=device))
        if gathered.cpu().tolist() != [[r] * 5 for r in range(world_size)]:
            problems.append(f"all_gather misrouted: {gathered.cpu().tolist()}")
        comm.barrier()
        record = _native.error_record(comm._control.address, rank)
        if record[0] != 0:
            problems.append(f"error record {record}")
    return problems


def reduce_until_error(rank: int, world_size: int, socket: str, report) -> tuple[str, str, float]:
    """All-reduce (and synchronise) in a loop until a call raises; returns (class, message, when)."""
    device = device_for(rank)
    torch.cuda.set_device(device)
    with nodecomm.connect("doomed", rank, world_size, device=device, socket=socket, timeout=120) as comm:
        x = torch.ones(1 << 16, device=device)
        for iteration in range(10**9):
            try:
                comm.all_reduce(x, path=PATHS[iteration % 3])
                torch.cuda.synchronize()
            except nodecomm.NodecommError as error:
                return type(error).__name__, str(error), time.time()
            if iteration == 50:
                report.put(rank)
    raise AssertionError("unreachable")


def wait_alone(rank: int, world_size: int, socket: str) -> tuple[str, str]:
    """Rank 0 all-reduces; rank 1 joins but never calls. Rank 0's kernel must give up."""
    device = device_for(rank)
    torch.cuda.set_device(device)
    with nodecomm.connect("alone", rank, world_size, device=device, socket=socket, timeout=120) as comm:
        if rank == 1:
            time.sleep(8.0)
            return "idle", ""
        comm.all_reduce(torch.ones(1024, device=device), path="oneshot")
        torch.cuda.synchronize()  # returns once the kernel times out
        try:
            comm.all_reduce(torch.ones(1024, device=device))
        except nodecomm.NodecommError as error:
            return type(error).__name__, str(error)
        return "no error", ""


def large_offsets(rank: int, world_size: int, socket: str, count: int) -> dict[str, int]:
    """A bf16 payload past 2 GiB in one slot: element offsets beyond 2^31 / 2. Inputs are small
    integers whose sums are exact and vary with the position, so a truncated offset shows."""
    device = device_for(rank)
    torch.cuda.set_device(device)
    capacity = count * 2
    with nodecomm.connect(
        "large", rank, world_size, device=device, socket=socket, timeout=300, capacity_bytes=capacity
    ) as comm:
        positions = torch.arange(count, device=device, dtype=torch.int32) % 251
        x = (positions + rank).to(torch.bfloat16)
        expected = (positions * world_size + world_size * (world_size - 1) // 2).to(torch.bfloat16)
        del positions
        wrong = {}
        for path in PATHS:
            out = comm.all_reduce(x, path=path)
            torch.cuda.synchronize()
            wrong[path] = int((out.view(torch.int16) != expected.view(torch.int16)).sum())
            del out
    return wrong


def nccl_fallback(rank: int, world_size: int, socket: str, port: int) -> dict:
    """With an NCCL group, the table's NCCL range runs through it; the custom paths stay exact."""
    import torch.distributed as dist

    device = device_for(rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        with nodecomm.connect(
            "with-nccl", rank, world_size, device=device, socket=socket, timeout=120, nccl_group=dist.group.WORLD
        ) as comm:
            table = [(lo, hi, p.value) for lo, hi, p in comm.thresholds().rows()]
            x = torch.full((1 << 20,), float(rank + 1), device=device)  # 4 MiB: the NCCL range
            y = comm.all_reduce(x)
            z = comm.all_reduce(x, path="nccl")
            torch.cuda.synchronize()
            total = float(world_size * (world_size + 1) // 2)
            return {"table": table, "default": bool((y == total).all()), "forced": bool((z == total).all())}
    finally:
        dist.destroy_process_group()
