"""nodecomm bench --op across-nodes: a group across stand-in nodes (a private daemon each, on this
machine) beside a flat gloo all-reduce over all its ranks, in one run. Rows per size: the
HierarchicalCommunicator as its table (the probe's at connect) decides ("auto"), forced to send
each node's whole sum between nodes ("flat") and forced to shard it ("sharded"), and gloo over
every rank. Time: the slowest rank's per iteration, each after a gloo barrier; p50."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import statistics

from .bench import PrivateDaemon, slowest_rank, spawn_ranks


def _rank_main(rank: int, world_size: int, args: dict, port: int, report) -> object:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import time

    import torch
    import torch.distributed as dist

    import nodecomm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    rows = []
    comm = nodecomm.connect_across_nodes("across-bench", socket=args["sockets"][rank], timeout=60)
    with comm:
        table = str(comm.table)  # the probe's, before any live move
        comm.forms.live = False  # every row times what it names
        for nbytes in args["sizes"]:
            x = torch.randn(max(1, nbytes // 4), generator=torch.Generator().manual_seed(rank))
            runs = {
                "auto": functools.partial(comm.all_reduce, x),
                "flat": functools.partial(comm.all_reduce, x, form="flat"),
                "sharded": functools.partial(comm.all_reduce, x, form="sharded"),
                "gloo": functools.partial(dist.all_reduce, x.clone()),
            }
            for name, run in runs.items():
                for _ in range(3):
                    run()
                times = []
                for _ in range(args["iterations"]):
                    dist.barrier()
                    started = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - started)
                slowest, _, _ = slowest_rank(times, 0, world_size)
                if rank == 0:
                    rows.append((nbytes, name, statistics.median(slowest)))
    dist.destroy_process_group()
    return {"table": table, "rows": rows} if rank == 0 else None


def run_across_nodes_bench(nodes: list[int], sizes: list[int], iterations: int) -> str:
    """`nodes[k]`: how many ranks stand-in node k has (ranks numbered node by node)."""
    with contextlib.ExitStack() as stack:
        daemons = [stack.enter_context(PrivateDaemon()) for _ in nodes]
        sockets = [daemons[k].socket for k, ranks in enumerate(nodes) for _ in range(ranks)]
        world_size = len(sockets)
        measured = spawn_ranks(_rank_main, world_size, {"sockets": sockets, "sizes": sizes, "iterations": iterations})
    table = measured["table"]
    p50 = {(nbytes, name): seconds * 1e6 for nbytes, name, seconds in measured["rows"]}
    shape = "x".join(map(str, nodes)) if len(set(nodes)) > 1 else f"{len(nodes)}x{nodes[0]}"
    lines = [
        f"# nodecomm bench --op across-nodes: nodes={shape} (a daemon each, this machine) world_size={world_size} "
        f"float32 iterations={iterations} host={platform.node()} cpus={os.cpu_count()}",
        f"# table: {table}",
        "# time: slowest rank per iteration, p50 in us; gloo = one flat all-reduce over every rank",
        "#",
        f"# {'size':>10} {'auto':>10} {'flat':>10} {'sharded':>10} {'gloo':>10} {'auto/gloo':>10}",
    ]
    for nbytes in sizes:
        auto, flat, sharded, gloo = (p50[(nbytes, name)] for name in ("auto", "flat", "sharded", "gloo"))
        lines.append(f"  {nbytes:>10} {auto:>10.1f} {flat:>10.1f} {sharded:>10.1f} {gloo:>10.1f} {auto / gloo:>10.3f}")
    return "\n".join(lines)
