"""vLLM's capture sequence through NodecommAllreduce (the custom all-reduce slot) on a fresh
private daemon (empty state directory: the built-in table), two ranks on GPU 0: inside the slot's
capture(), each size warmed up by one custom_all_reduce, then CALLS of them captured in one graph,
as vLLM's capture loop does (warm-up in CUDAGraphMode.NONE, then the capture); beside it, the same
size captured with every call forced onto each lossless path. Rank 0 prints, per size, the p50
per-call time of REPLAYS replays of each graph and auto's over the best path's; the sizes the
slot declines (the table gives them NCCL, which vLLM runs itself) are named.
    python .ci/vllm-capture-regret.py"""

import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CALLS, REPLAYS = 20, 20
SIZES = [1 << k for k in range(10, 27)]  # 1 KiB .. 64 MiB
PATHS = ("oneshot", "twoshot", "dma")


def graph_us(run) -> float:
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(CALLS):
            run()
    graph.replay()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(REPLAYS + 1)]
    dist.barrier()
    torch.cuda.synchronize()
    events[0].record()
    for event in events[1:]:
        graph.replay()
        event.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(events, events[1:], strict=False)) * 1e3 / CALLS


def rank_main(rank: int, socket: str, port: int) -> None:
    from nodecomm.integrations.custom_all_reduce import NodecommAllreduce

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    slot = NodecommAllreduce(dist.group.WORLD, torch.device("cuda", 0), max_size=64 << 20, socket=socket)
    assert not slot.disabled, slot.disabled_reason
    # A graph of the first size, replayed and dropped: the first graph a process replayed ran 4-6%
    # slower than the same kernel's graphs after it (auto at 1 KiB over forced oneshot, one H100).
    first = torch.ones(SIZES[0] // 2, dtype=torch.bfloat16, device="cuda")
    graph_us(lambda: slot.comm.all_reduce(first, out=torch.empty_like(first), path="oneshot"))
    rows = []
    for nbytes in SIZES:
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        if not slot.should_custom_ar(x):  # the table gives it NCCL: vLLM's own all-reduce runs it
            rows.append((nbytes, None, {}))
            continue
        with slot.capture():
            slot.custom_all_reduce(x)  # the warm-up
            auto = graph_us(lambda x=x: slot.custom_all_reduce(x))
        out = torch.empty_like(x)
        forced = {p: graph_us(lambda p=p, x=x, out=out: slot.comm.all_reduce(x, out=out, path=p)) for p in PATHS}
        rows.append((nbytes, auto, forced))
    if rank == 0:
        print(f"{'bytes':>9} {'auto us':>8} " + " ".join(f"{p:>8}" for p in PATHS) + "  auto/best  best")
        for nbytes, auto, forced in rows:
            if auto is None:
                print(f"{nbytes:>9} declined: the table gives it NCCL, which vLLM runs")
                continue
            best = min(forced, key=forced.get)
            cells = " ".join(f"{forced[p]:8.2f}" for p in PATHS)
            print(f"{nbytes:>9} {auto:8.2f} {cells}  {auto / forced[best]:9.3f}  {best}")
    slot.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    from nodecomm.tools.bench import PrivateDaemon
    from nodecomm.tools.ranks import free_port

    daemon = PrivateDaemon("--allow-shared-devices", "true")
    try:
        mp.spawn(rank_main, args=(daemon.socket, free_port()), nprocs=2)
    finally:
        daemon.stop()
    sys.exit(0)
