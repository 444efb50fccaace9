"""nodecomm bench --op topk-merge: vLLM's DCP top-k merge on the owner exchange (Exchange.merge)
beside the merge vLLM runs without it, in one run: every rank's packed candidates all-gathered
(nodecomm's all_gather, which torch's all_gather_into_tensor runs on a "nodecomm" group), then
every rank selects every row with torch.topk on vLLM's key. Both start from the same logits and
local top-k, both end with every row's global top-k in topk_indices (checked equal as sets per
row), and both put topk_indices back first (a merge overwrites it). Time: the slowest rank per
call, p50, calls back to back between CUDA events (or after a barrier on the CPU)."""

from __future__ import annotations

import functools
import statistics

from .bench import describe_machine, run_ranks, start_rank
from .topk_bench import slowest_times

SCORE_BITS, ID_BITS = 16, 20  # bf16 logits; positions below 2^20


def _exchange_merge(exchange, logits, given, local) -> None:
    local.copy_(given)
    exchange.merge(logits, local, score_bits=SCORE_BITS, id_bits=ID_BITS)


def _gathered_merge(comm, logits, given, local, topk: int, world_size: int) -> None:
    """The merge without the exchange: every rank's candidates to every rank, every rank selects
    every row (the key as in client/topk_merge.py, in one int64: score bits, then the id's)."""
    import torch

    from nodecomm.client.topk_merge import candidates

    local.copy_(given)
    ids, scores = candidates(logits, local, comm.rank, world_size, 1, None)
    everyone = comm.all_gather(torch.stack((ids, scores.view(torch.int32)), -1))  # [world, rows, topk, 2]
    shape = (local.shape[0], world_size * topk)  # rows, every rank's candidates
    every_id = everyone[..., 0].permute(1, 0, 2).reshape(shape)
    bits = everyone[..., 1].permute(1, 0, 2).reshape(shape).long() & 0xFFFFFFFF
    flipped = torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits ^ 0x80000000) >> (32 - SCORE_BITS)
    key = (flipped << ID_BITS) | (~every_id.long() & ((1 << ID_BITS) - 1))
    key = key.masked_fill(every_id < 0, -1)
    best = torch.topk(key, topk, dim=1).indices
    local.copy_(torch.gather(every_id, 1, best).masked_fill(torch.gather(key, 1, best) < 0, -1))


def _rank_main(rank: int, world_size: int, args: dict, port: int, report) -> object:
    device = start_rank(rank, world_size, args, port)
    import torch
    import torch.distributed as dist

    import nodecomm

    topk, rows_list = args["topk"], args["rows"]
    out = []
    with nodecomm.connect("merge-bench", rank, world_size, device=device, socket=args["socket"], timeout=60) as comm:
        exchange = comm.topk_exchange(max(rows_list), topk)
        for rows in rows_list:
            generator = torch.Generator().manual_seed(rank)
            logits = torch.randn(rows, 2 * topk, generator=generator).bfloat16().float().to(device)
            given = torch.rand(rows, 2 * topk, generator=generator).argsort(dim=1)[:, :topk].to(torch.int32).to(device)
            local = given.clone()

            runs = {
                "merge": functools.partial(_exchange_merge, exchange, logits, given, local),
                "gather+topk": functools.partial(_gathered_merge, comm, logits, given, local, topk, world_size),
            }
            results = {}
            for name, run in runs.items():
                run()
                results[name] = local.sort(dim=1).values.clone()
            same = torch.equal(results["merge"], results["gather+topk"])
            for name, (slowest, differ) in slowest_times(
                runs, int(not same), comm, device != "cpu", args, world_size
            ).items():
                if rank == 0:
                    out.append((rows, name, slowest, differ))
    dist.destroy_process_group()
    return out if rank == 0 else None


def run_topk_merge_bench(
    world_size: int, rows_list: list[int], topk: int, iterations: int, socket: str | None, device: str = "cpu"
) -> str:
    gpus = 0
    if device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    shared = device == "cuda" and world_size > gpus
    args = {"rows": rows_list, "topk": topk, "iterations": iterations, "device": device}
    flags = ("--allow-shared-devices", "true") if shared else ()
    raw = run_ranks(_rank_main, world_size, args, socket, flags)
    p50 = {(rows, kind): statistics.median(times) * 1e6 for rows, kind, times, _ in raw}
    differ = {rows for rows, _, _, bad in raw if bad}
    machine = describe_machine(device)
    lines = [
        f"# nodecomm bench --op topk-merge: device={device} world_size={world_size} topk={topk} "
        f"iterations={iterations} {machine}",
        "# time: slowest rank per call, p50; gather+topk = every rank's candidates all-gathered (nodecomm's "
        "all_gather), every rank selects every row (torch.topk on vLLM's key)",
        "#",
        f"# {'rows':>6} {'merge(us)':>11} {'gather+topk(us)':>16} {'ratio':>7} {'same sets':>9}",
    ]
    if shared:
        lines.insert(2, f"# the {world_size} ranks share {gpus} GPU(s)")
    for rows in rows_list:
        merge, base = p50[(rows, "merge")], p50[(rows, "gather+topk")]
        same = "no" if rows in differ else "yes"
        lines.append(f"  {rows:>6} {merge:>11.1f} {base:>16.1f} {merge / base:>7.3f} {same:>9}")
    return "\n".join(lines)
