"""nodecomm bench --op convergence: how many calls a fresh group's table needs to pick the fastest
path. A private daemon with an empty state directory (or one whose stored calibration sends every
size to one path, --table; or the daemon --socket names) serves one group. Per size, the ranks
first make `calls` default-dispatched all-reduces in windows of WINDOW calls (live recalibration
and exploration as the daemon is set), then time every single path the same way, forced,
afterwards (forced calls are timed for the daemon too, so they must not come first). Reported per
size: the best single path; the call count and seconds from the size's first call after which
the table gives the size the path it ends on, and after which auto stays within 5% of the best
(the slowest rank's time per window, as the median of 5 windows); auto's last windows against the
best.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time

from nodecomm.byte_size import format_byte_size

from .bench import run_ranks, slowest_rank, start_rank

WINDOW = 50  # calls per timed window
PROBE_WINDOWS = 20  # windows per forced path
WITHIN = 1.05  # "converged": auto's window at most this many times the best path's p50
ROLLING = 5  # windows a window's time is the median of


def _window_times(run, windows: int, comm, on_gpu: bool, nbytes: int) -> tuple[list[float], list[float], list[str]]:
    """Per-call seconds of `windows` windows of WINDOW calls back to back, the seconds since the
    first window began at each window's end (host clock), and the path the table in force gave
    `nbytes` before the first window and at each window's end."""
    import torch

    comm.barrier()
    started = time.perf_counter()
    per_call, elapsed, paths = [], [], [comm.thresholds().path_for(nbytes).value]
    for _ in range(windows):
        if on_gpu:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(WINDOW):
                run()
            end.record()
            end.synchronize()
            per_call.append(begin.elapsed_time(end) / 1e3 / WINDOW)
        else:
            window_start = time.perf_counter()
            for _ in range(WINDOW):
                run()
            per_call.append((time.perf_counter() - window_start) / WINDOW)
        elapsed.append(time.perf_counter() - started)
        paths.append(comm.thresholds().path_for(nbytes).value)
    return per_call, elapsed, paths


def _rank_main(rank: int, world_size: int, args: dict, port: int, report) -> object:
    device = start_rank(rank, world_size, args, port)
    import torch
    import torch.distributed as dist

    import nodecomm
    from nodecomm.capabilities import path_names

    on_gpu = device != "cpu"
    paths = [name for name in path_names(args["device"]) if name != "service"]
    out = []
    with nodecomm.connect(args["group"], rank, world_size, device=device, socket=args["socket"], timeout=60) as comm:
        for nbytes in args["sizes"]:
            x = torch.ones(nbytes // 4, device=device)
            result = torch.empty_like(x)
            auto_call = functools.partial(comm.all_reduce, x, out=result)
            auto, elapsed, table = _window_times(auto_call, args["calls"] // WINDOW, comm, on_gpu, nbytes)
            auto, _, _ = slowest_rank(auto, 0, world_size)
            elapsed, _, _ = slowest_rank(elapsed, 0, world_size)
            best = {}
            for path in paths:
                forced = functools.partial(comm.all_reduce, x, out=result, path=path)
                times, _, _ = _window_times(forced, PROBE_WINDOWS, comm, on_gpu, nbytes)
                best[path] = statistics.median(slowest_rank(times, 0, world_size)[0])
            if rank == 0:
                out.append((nbytes, auto, elapsed, best, table))
    dist.destroy_process_group()
    return out if rank == 0 else None


def converged_at(auto: list[float], best: float) -> int | None:
    """The first window from which auto stays within WITHIN of `best`, or None. A window counts by
    the median of it and the ROLLING - 1 before it: one window a busy machine slowed is no reason
    to say the table left the best path."""
    at = None
    for index in range(len(auto)):
        if statistics.median(auto[max(0, index - ROLLING + 1) : index + 1]) > best * WITHIN:
            at = None
        elif at is None:
            at = index
    return at


# Boundaries that send every size to one path: the deliberately wrong tables.
_EVERY_SIZE_TO = {
    "oneshot": {"oneshot_max_bytes": 1 << 40, "twoshot_max_bytes": None, "dma_min_bytes": None},
    "twoshot": {"oneshot_max_bytes": None, "twoshot_max_bytes": 1 << 40, "dma_min_bytes": None},
    "dma": {"oneshot_max_bytes": None, "twoshot_max_bytes": None, "dma_min_bytes": 0},
}


def every_size_to(path: str, device: str):
    """A stored calibration of this machine (as the daemon fingerprints it) whose boundaries send
    every all-reduce of `device`'s groups to `path`."""
    from nodecomm import _native
    from nodecomm.service.calibration.fingerprint import cpu_fingerprint, cuda_fingerprint, fingerprint_key
    from nodecomm.service.calibration.stored import Calibration

    if device == "cuda":
        fingerprint = cuda_fingerprint(_native.cuda_devices(), _native.cuda_peer_links())
        boundaries = dict(_EVERY_SIZE_TO[path])
    else:  # CPU groups have oneshot_max_bytes alone, twoshot above it
        fingerprint = cpu_fingerprint()
        boundaries = {"oneshot_max_bytes": _EVERY_SIZE_TO[path]["oneshot_max_bytes"]}
    return Calibration(fingerprint_key(fingerprint), fingerprint, boundaries, {}, time.time())


def run_convergence_bench(
    world_size: int,
    sizes: list[int],
    calls: int,
    socket: str | None,
    device: str,
    daemon_flags: tuple[str, ...],
    table: str | None = None,
) -> str:
    """`table`: a path every size goes to by a stored calibration (None: the built-in table)."""
    flags = daemon_flags
    if device == "cuda":
        import torch

        if world_size > torch.cuda.device_count():
            flags = ("--allow-shared-devices", "true", *flags)
    args = {"sizes": sizes, "calls": max(calls, WINDOW), "device": device}
    stored = None if table is None else every_size_to(table, device)
    raw = run_ranks(_rank_main, world_size, args, socket, flags, stored=stored)
    lines = [
        f"# nodecomm bench --op convergence: device={device} world_size={world_size} calls={calls} "
        f"window={WINDOW} host={platform.node()} cpus={os.cpu_count()} daemon flags: {' '.join(daemon_flags) or '-'}"
        f" start: {'every size to ' + table + ' (stored)' if table else 'built-in table'}",
        "# on path: the call (and seconds) from which the table gives the size the path it ends on; "
        f"within: from which auto (a median of {ROLLING} windows) stays within {WITHIN:.2f}x of the best single "
        f"path's p50; last: auto's median over the last {ROLLING * 2} windows / best",
        f"# {'size':>8} {'best':>8} {'best(us)':>9} {'table':>8} {'on path':>8} {'seconds':>8} {'within':>8} "
        f"{'seconds':>8} {'last':>6}",
    ]
    for nbytes, auto, elapsed, best, paths in raw:
        winner = min(best, key=best.get)
        settled = next(i for i in range(len(paths)) if set(paths[i:]) == {paths[-1]})
        at = converged_at(auto, best[winner])
        lines.append(
            f"  {format_byte_size(nbytes):>8} {winner:>8} {best[winner] * 1e6:>9.1f} {paths[-1]:>8} "
            f"{_calls(settled, elapsed)} {_calls(at, elapsed)} {statistics.median(auto[-ROLLING * 2 :]) / best[winner]:>6.2f}"
        )
    return "\n".join(lines)


def _calls(window: int | None, elapsed: list[float]) -> str:
    """A window's index as calls before it, and seconds (the end of the window before it)."""
    if window is None:
        return f"{'never':>8} {'-':>8}"
    return f"{window * WINDOW:>8} {(elapsed[window - 1] if window else 0.0):>8.2f}"
