"""nodecomm bench --op topk: TopkExchange.stage beside gather-then-slice through torch.distributed,
in one run. The baseline all-gathers every rank's [rows, topk] candidates (indices and scores)
and each owner slices out its rows, giving the same [owned_rows, world_size, topk] table: gloo on
the CPU, NCCL on GPUs with one rank per GPU, and gloo through host copies where ranks share a
GPU (NCCL refuses those). Time:
the slowest rank's per iteration; on the CPU each iteration after a barrier, on GPUs iterations
back to back between CUDA events."""

from __future__ import annotations

import functools
import statistics

from .bench import cuda_times, describe_machine, host_times, run_ranks, slowest_rank, start_rank


def _gather_then_slice(idx, scores, span: range, world_size: int, group=None, via_host: bool = False):
    """The baseline: every rank's candidates everywhere, then this owner's rows of each. With
    via_host (gloo for ranks sharing a GPU) the copies to the host and back are part of its cost."""
    import torch
    import torch.distributed as dist

    if via_host:
        tables = _gather_then_slice(idx.cpu(), scores.cpu(), span, world_size)
        return tuple(t.to(idx.device) for t in tables)
    all_idx = [torch.empty_like(idx) for _ in range(world_size)]
    all_scores = [torch.empty_like(scores) for _ in range(world_size)]
    dist.all_gather(all_idx, idx, group=group)
    dist.all_gather(all_scores, scores, group=group)
    mine = slice(span.start, span.stop)
    return torch.stack([t[mine] for t in all_idx], 1), torch.stack([t[mine] for t in all_scores], 1)


def _rank_main(rank: int, world_size: int, args: dict, port: int, report) -> object:
    device = start_rank(rank, world_size, args, port)
    import torch
    import torch.distributed as dist

    import nodecomm
    from nodecomm.topk_layout import owned_rows

    on_gpu = device != "cpu"
    baseline = args["baseline"]
    group = dist.new_group(backend="nccl") if baseline == "nccl" else None
    topk, rows_list = args["topk"], args["rows"]
    out = []
    with nodecomm.connect("topk-bench", rank, world_size, device=device, socket=args["socket"], timeout=60) as comm:
        exchange = comm.topk_exchange(max(rows_list), topk)
        for rows in rows_list:
            generator = torch.Generator().manual_seed(rank)
            idx = torch.randint(0, 1 << 30, (rows, topk), generator=generator, dtype=torch.int32).to(device)
            scores = torch.randn(rows, topk, generator=generator).to(device)
            span = owned_rows(rows, world_size, rank)

            runs = {
                "stage": functools.partial(exchange.stage, idx, scores),
                baseline: functools.partial(
                    _gather_then_slice, idx, scores, span, world_size, group, via_host=on_gpu and baseline == "gloo"
                ),
            }
            tables = {name: run() for name, run in runs.items()}
            same = all(torch.equal(a, b) for a, b in zip(tables["stage"], tables[baseline], strict=True))
            for name, (slowest, differ) in slowest_times(runs, int(not same), comm, on_gpu, args, world_size).items():
                if rank == 0:
                    out.append((rows, name, slowest, differ))
    dist.destroy_process_group()
    return out if rank == 0 else None


def slowest_times(runs: dict, flaws: int, comm, on_gpu: bool, args: dict, world_size: int) -> dict:
    """Each run's iterations timed (back to back between CUDA events on GPUs, after a barrier on
    the CPU): name -> (the slowest rank's times, the flaws counted over every rank)."""
    timed = {}
    for name, run in runs.items():
        if on_gpu:
            times = cuda_times(run, args["iterations"], comm, graph=False)
        else:
            times = host_times(run, args["iterations"], comm)
        slowest, differ, _ = slowest_rank(times, flaws, world_size)
        timed[name] = (slowest, differ)
    return timed


def run_topk_bench(
    world_size: int, rows_list: list[int], topk: int, iterations: int, socket: str | None, device: str = "cpu"
) -> str:
    gpus = 0
    if device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    shared = device == "cuda" and world_size > gpus
    name = "nccl" if device == "cuda" and not shared else "gloo"
    args = {"rows": rows_list, "topk": topk, "iterations": iterations, "device": device, "baseline": name}
    flags = ("--allow-shared-devices", "true") if shared else ()
    raw = run_ranks(_rank_main, world_size, args, socket, flags)
    p50 = {(rows, kind): statistics.median(times) * 1e6 for rows, kind, times, _ in raw}
    differ = {rows for rows, _, _, bad in raw if bad}
    machine = describe_machine(device)
    lines = [
        f"# nodecomm bench --op topk: device={device} world_size={world_size} topk={topk} iterations={iterations} {machine}",
        f"# time: slowest rank per iteration, p50; {name} = all_gather of indices and scores, then each owner slices",
        "#",
        f"# {'rows':>6} {'stage(us)':>11} {name + '(us)':>11} {'stage/' + name:>10} {'tables equal':>12}",
    ]
    if shared:
        lines.insert(2, "# ranks share a GPU, which NCCL refuses: gloo gathers host copies instead")
    for rows in rows_list:
        stage = p50[(rows, "stage")]
        base = p50[(rows, name)]
        equal = "no" if rows in differ else "yes"
        lines.append(f"  {rows:>6} {stage:>11.1f} {base:>11.1f} {stage / base:>10.3f} {equal:>12}")
    return "\n".join(lines)
