"""nodecomm bench: every path beside the baseline, in one run, in nccl-tests' units.

Spawns `world_size` rank processes that join one group through a daemon (a private one on a
temporary socket unless --socket names a running daemon) and also form a torch.distributed gloo
group. For each size and path, each rank times every iteration after a barrier; an iteration's
time is the slowest rank's. busbw = algbw * 2(n-1)/n, as nccl-tests reports for all-reduce.
Inputs are small integers so that the sum is exact; #wrong counts elements that differ from it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import queue
import socket as socketlib
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import grpc

from nodecomm.byte_size import format_byte_size
from nodecomm.socket_path import grpc_target

BASELINE = "gloo"


@dataclass
class Row:
    size_bytes: int
    count: int
    dtype: str
    path: str
    p50_us: float
    p99_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int
    iterations: int


def sizes_between(low: int, high: int) -> list[int]:
    sizes, size = [], low
    while size <= high:
        sizes.append(size)
        size *= 2
    return sizes


def iterations_for(nbytes: int) -> int:
    return max(10, min(300, (128 << 20) // max(nbytes, 1)))


def _free_port() -> int:
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _operation(path: str, comm, dist, x, out):
    """One timed all-reduce of x into out: through gloo (in place on a copy) or a nodecomm path."""
    if path == BASELINE:

        def run() -> None:
            out.copy_(x)
            dist.all_reduce(out)
    else:
        chosen = None if path == "auto" else path

        def run() -> None:
            comm.all_reduce(x, out=out, path=chosen)

    return run


def _rank_main(rank: int, world_size: int, args: dict, port: int, results: mp.Queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import nodecomm

    torch.set_num_threads(1)
    dtype = getattr(torch, args["dtype"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    rows = []
    with nodecomm.connect("bench", rank, world_size, socket=args["socket"], timeout=60) as comm:
        for nbytes in args["sizes"]:
            count = nbytes // torch.tensor([], dtype=dtype).element_size()
            pattern = torch.arange(count) % 13
            x = (pattern + rank).to(dtype)
            expected = (pattern * world_size + world_size * (world_size - 1) // 2).to(dtype)
            out = torch.empty_like(x)
            iterations = iterations_for(nbytes)
            for path in args["paths"]:
                run = _operation(path, comm, dist, x, out)
                for _ in range(min(5, iterations)):
                    run()
                times = []
                for _ in range(iterations):
                    comm.barrier()
                    started = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - started)
                mine = torch.tensor([*times, float((out != expected).sum())], dtype=torch.float64)
                gathered = [torch.empty_like(mine) for _ in range(world_size)]
                dist.all_gather(gathered, mine)
                if rank == 0:
                    every = torch.stack(gathered)
                    slowest = every[:, :iterations].max(dim=0).values.tolist()
                    rows.append((nbytes, count, path, slowest, int(every[:, iterations].sum())))
    dist.destroy_process_group()
    if rank == 0:
        results.put(rows)


def _wait_for_rows(results: mp.Queue, ranks: list) -> list:
    """Rank 0's rows; fails as soon as any rank dies instead of waiting on the survivors."""
    deadline = time.monotonic() + 3600
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=0.5)
        except queue.Empty:
            failed = {r: p.exitcode for r, p in enumerate(ranks) if p.exitcode not in (None, 0)}
            if failed:
                raise RuntimeError(f"bench ranks failed (rank: exit code): {failed}") from None
    raise TimeoutError("the bench did not finish within an hour")


def _row(nbytes: int, count: int, dtype: str, path: str, times: list[float], wrong: int, world_size: int) -> Row:
    ordered = sorted(times)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    algbw = nbytes / p50 / 1e9 if p50 > 0 else 0.0
    busbw = algbw * (2 * (world_size - 1) / world_size) if world_size > 1 else 0.0
    return Row(nbytes, count, dtype, path, p50 * 1e6, p99 * 1e6, algbw, busbw, wrong, len(times))


class PrivateDaemon:
    """A daemon on a temporary socket, for runs that are not pointed at a running one."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="nodecomm-bench-")
        self.socket = os.path.join(self.directory, "nodecomm.sock")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nodecomm.service.server",
                "--socket",
                self.socket,
                "--metrics-address",
                "off",
                "--log-level",
                "WARNING",
            ],
        )
        channel = grpc.insecure_channel(grpc_target(self.socket))
        try:
            grpc.channel_ready_future(channel).result(timeout=30)
        except grpc.FutureTimeoutError:
            self.process.kill()
            raise RuntimeError(f"the private daemon did not start serving on {self.socket} within 30 s") from None
        finally:
            channel.close()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def run_bench(world_size: int, sizes: list[int], paths: list[str], dtype: str, socket: str | None) -> list[Row]:
    daemon = None if socket else PrivateDaemon()
    try:
        args = {"sizes": sizes, "paths": paths, "dtype": dtype, "socket": socket or daemon.socket}
        context = mp.get_context("spawn")
        results = context.Queue()
        port = _free_port()
        ranks = [
            context.Process(target=_rank_main, args=(r, world_size, args, port, results)) for r in range(world_size)
        ]
        for process in ranks:
            process.start()
        try:
            raw = _wait_for_rows(results, ranks)
        finally:
            for process in ranks:
                process.join(timeout=60)
                if process.is_alive():
                    process.kill()
    finally:
        if daemon is not None:
            daemon.stop()
    return [_row(n, c, dtype, p, t, w, world_size) for n, c, p, t, w in raw]


def format_table(rows: list[Row], world_size: int, dtype: str) -> str:
    baseline = {r.size_bytes: r for r in rows if r.path == BASELINE}
    lines = [
        f"# nodecomm bench: device=cpu world_size={world_size} dtype={dtype} "
        f"host={platform.node()} cpus={os.cpu_count()} python={platform.python_version()}",
        "# time: slowest rank per iteration; busbw = algbw * 2(n-1)/n; vs gloo: p50 latency ratio and busbw ratio",
        "#",
        f"# {'size':>9} {'count':>10} {'type':>8} {'path':>8} {'p50(us)':>10} {'p99(us)':>10} "
        f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6} {'lat/gloo':>9} {'bw/gloo':>8}",
    ]
    for r in rows:
        base = baseline.get(r.size_bytes)
        lat = f"{r.p50_us / base.p50_us:9.3f}" if base and r.path != BASELINE else f"{'':9}"
        bw = f"{r.busbw_gbps / base.busbw_gbps:8.2f}" if base and r.path != BASELINE and base.busbw_gbps else f"{'':8}"
        lines.append(
            f"  {format_byte_size(r.size_bytes):>9} {r.count:>10} {r.dtype:>8} {r.path:>8} {r.p50_us:>10.1f} "
            f"{r.p99_us:>10.1f} {r.algbw_gbps:>11.3f} {r.busbw_gbps:>11.3f} {r.wrong:>6} {lat} {bw}"
        )
    return "\n".join(lines)


def write_json(path: str, rows: list[Row], world_size: int, dtype: str) -> None:
    document = {
        "device": "cpu",
        "world_size": world_size,
        "dtype": dtype,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "baseline": BASELINE,
        "rows": [asdict(r) for r in rows],
    }
    with open(path, "w") as handle:
        json.dump(document, handle, indent=2)
