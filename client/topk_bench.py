"""nodecomm bench --op topk: TopkExchange.stage beside gather-then-slice through torch.distributed,
in one run. The baseline all-gathers every rank's [rows, topk] candidates (indices and scores)
and each owner slices out its rows, giving the same [owned_rows, world_size, topk] table. Time:
the slowest rank's per iteration, each iteration after a barrier."""

from __future__ import annotations

import functools
import os
import platform
import statistics

from .bench import host_times, run_ranks, slowest_rank


def _gather_then_slice(idx, scores, span: range, world_size: int):
    """The baseline: every rank's candidates everywhere, then this owner's rows of each."""
    import torch
    import torch.distributed as dist

    all_idx = [torch.empty_like(idx) for _ in range(world_size)]
    all_scores = [torch.empty_like(scores) for _ in range(world_size)]
    dist.all_gather(all_idx, idx)
    dist.all_gather(all_scores, scores)
    mine = slice(span.start, span.stop)
    return torch.stack([t[mine] for t in all_idx], 1), torch.stack([t[mine] for t in all_scores], 1)


def _rank_main(rank: int, world_size: int, args: dict, port: int, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import nodecomm
    from nodecomm.topk_layout import owned_rows

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    topk, rows_list = args["topk"], args["rows"]
    out = []
    with nodecomm.connect("topk-bench", rank, world_size, socket=args["socket"], timeout=60) as comm:
        exchange = comm.topk_exchange(max(rows_list), topk)
        for rows in rows_list:
            generator = torch.Generator().manual_seed(rank)
            idx = torch.randint(0, 1 << 30, (rows, topk), generator=generator, dtype=torch.int32)
            scores = torch.randn(rows, topk, generator=generator)
            span = owned_rows(rows, world_size, rank)

            runs = {
                "stage": functools.partial(exchange.stage, idx, scores),
                "gloo": functools.partial(_gather_then_slice, idx, scores, span, world_size),
            }
            tables = {name: run() for name, run in runs.items()}
            same = all(torch.equal(a, b) for a, b in zip(tables["stage"], tables["gloo"], strict=True))
            for name, run in runs.items():
                slowest, differ = slowest_rank(host_times(run, args["iterations"], comm), int(not same), world_size)
                if rank == 0:
                    out.append((rows, name, slowest, differ))
    dist.destroy_process_group()
    if rank == 0:
        results.put(out)


def run_topk_bench(world_size: int, rows_list: list[int], topk: int, iterations: int, socket: str | None) -> str:
    raw = run_ranks(_rank_main, world_size, {"rows": rows_list, "topk": topk, "iterations": iterations}, socket)
    p50 = {(rows, name): statistics.median(times) * 1e6 for rows, name, times, _ in raw}
    differ = {rows for rows, _, _, bad in raw if bad}
    lines = [
        f"# nodecomm bench --op topk: world_size={world_size} topk={topk} iterations={iterations} "
        f"host={platform.node()} cpus={os.cpu_count()} python={platform.python_version()}",
        "# time: slowest rank per iteration, p50; gloo = all_gather of indices and scores, then each owner slices",
        "#",
        f"# {'rows':>6} {'stage(us)':>11} {'gloo(us)':>11} {'stage/gloo':>10} {'tables equal':>12}",
    ]
    for rows in rows_list:
        stage, gloo = p50[(rows, "stage")], p50[(rows, "gloo")]
        equal = "no" if rows in differ else "yes"
        lines.append(f"  {rows:>6} {stage:>11.1f} {gloo:>11.1f} {stage / gloo:>10.3f} {equal:>12}")
    return "\n".join(lines)
