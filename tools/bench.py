"""nodecomm bench: every path beside the baseline, in one run, in nccl-tests' units.

Spawns `world_size` rank processes that join one group through a daemon (a private one on a
temporary socket unless --socket names a running daemon) and also form a torch.distributed group:
gloo on the CPU, which is the CPU baseline, and on GPUs an NCCL group, the GPU baseline (NCCL
refuses ranks that share a GPU, so with more ranks than GPUs the run has no baseline). An
iteration's time is the slowest rank's: on the CPU each iteration is timed after a barrier; on
GPUs eager iterations (EAGER_BATCH calls each) run back to back between CUDA events, and with
--graph `iterations` calls are captured in one CUDA graph whose replays are timed, per call. busbw = algbw * 2(n-1)/n, as
nccl-tests reports for all-reduce. Inputs are small integers so that the sum is exact; #wrong
counts elements that differ from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nodecomm.socket_path import PRIVATE_LOG_NAME, lease_socket_path

from ..client.daemon_choice import JobLeaseHandle
from ..client.daemon_process import interrupts_held, start_daemon
from .ranks import RankProcesses, free_port

if TYPE_CHECKING:
    from nodecomm.service.calibration.stored import Calibration

BASELINES = {"cpu": "gloo", "cuda": "nccl"}
# Rows of one nodecomm path, forced (the others: auto, the baselines, the backend's).
NODECOMM_PATHS = frozenset({"oneshot", "twoshot", "dma", "service"})
GRAPH_REPLAYS = 5
EAGER_BATCH = 10  # calls between two CUDA events in eager mode, as nccl-tests times its iterations


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
    p25_us: float  # with p75_us, the middle half of the iterations: the point's spread
    p75_us: float
    # The least CPU time any rank had while timed, per second of wall time: ranks that spin on
    # host memory (CPU groups) use a whole core each on an idle machine, and less on a busy one.
    cpu_share: float = 1.0
    variant: str = ""  # how a forced path moved this size: "push" or "pull" for CUDA oneshot

    @property
    def label(self) -> str:
        return f"{self.path}/{self.variant}" if self.variant else self.path


def describe_machine(device: str) -> str:
    """The machine a bench ran on, for its header: host, cores, Python; on CUDA the GPU, how many,
    and torch."""
    machine = f"host={platform.node()} cpus={os.cpu_count()} python={platform.python_version()}"
    if device == "cuda":
        import torch

        machine += (
            f" gpu={torch.cuda.get_device_name(0)!r} visible_gpus={torch.cuda.device_count()} torch={torch.__version__}"
        )
    return machine


def sizes_between(low: int, high: int) -> list[int]:
    sizes, size = [], low
    while size <= high:
        sizes.append(size)
        size *= 2
    return sizes


def iterations_for(nbytes: int) -> int:
    return max(10, min(300, (128 << 20) // max(nbytes, 1)))


# Not paths: dist.all_reduce through the "nodecomm" torch.distributed backend, and what it runs
# underneath (the input copied into the output, then comm.all_reduce in place), both by the table.
BACKEND_ROW = "torch"
DIRECT_ROW = "inplace"


def _operation(path: str, comm, dist, x, out, group):
    """One timed all-reduce of x into out. The baseline copies x into out and reduces that in
    place, as nodecomm's NCCL route does; timed back to back in place instead, NCCL under graph
    replay was 1.6-3x slower for small messages (docs/bench-gpu.md), which flattered every path
    compared with it. The backend row does the same through the "nodecomm" process group."""
    if path in BASELINES.values() or path == BACKEND_ROW:

        def run() -> None:
            out.copy_(x)
            dist.all_reduce(out, group=group)
    elif path == DIRECT_ROW:

        def run() -> None:
            out.copy_(x)
            comm.all_reduce(out, out=out)
    else:
        # "oneshot+int8": a path over a compressed wire; "auto+int8": the table's path, compressed.
        name, _, wire = path.partition("+")
        chosen = None if name == "auto" else name

        def run() -> None:
            comm.all_reduce(x, out=out, path=chosen, wire=wire or None)

    return run


def _flaws(path: str, out, expected) -> int:
    """Elements that differ from the exact sum; on a compressed wire (which is not exact), ranks
    whose result's bits differ from rank 0's (the contract there), through the gloo group."""
    import hashlib

    import torch
    import torch.distributed as dist

    if "+" not in path:
        return int((out != expected).sum())
    digests: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(digests, hashlib.sha256(out.view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest())
    return int(dist.get_rank() == 0 and any(d != digests[0] for d in digests))


def slowest_rank(
    times: list[float], flaws: int, world_size: int, cpu_share: float = 1.0
) -> tuple[list[float], int, float]:
    """Every iteration's slowest time over the ranks, the flaws counted over all of them, and the
    least CPU share any rank had (through the gloo group every bench rank holds)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([*times, float(flaws), cpu_share], dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    every = torch.stack(gathered)
    return every[:, :-2].max(dim=0).values.tolist(), int(every[:, -2].sum()), float(every[:, -1].min())


def host_times(run, iterations: int, comm) -> list[float]:
    times = []
    for _ in range(iterations):
        comm.barrier()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return times


def cuda_times(run, iterations: int, comm, graph: bool) -> list[float]:
    """Eager: per-call times of `iterations` batches of EAGER_BATCH calls back to back (an event
    recorded around every call would add its own enqueue to each: docs/bench-gpu.md, "Eager
    calls"). Graph: per-call times of GRAPH_REPLAYS replays of one graph holding `iterations` calls."""
    import torch

    if graph:
        captured = torch.cuda.CUDAGraph()
        capture_stream = torch.cuda.Stream()
        capture_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(capture_stream), torch.cuda.graph(captured, stream=capture_stream):
            for _ in range(iterations):
                run()
        calls, steps = iterations, GRAPH_REPLAYS

        def step() -> None:
            captured.replay()
    else:
        calls, steps = EAGER_BATCH, iterations

        def step() -> None:
            for _ in range(EAGER_BATCH):
                run()

    comm.barrier()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    events[0].record()
    for i in range(steps):
        step()
        events[i + 1].record()
    torch.cuda.synchronize()
    return [events[i].elapsed_time(events[i + 1]) / 1e3 / calls for i in range(steps)]


def start_rank(rank: int, world_size: int, args: dict, port: int) -> str:
    """A bench rank's process: one thread, its GPU (ranks spread over the visible ones) or the CPU,
    and the gloo group every rank holds for slowest_rank. Returns the device."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = f"cuda:{rank % torch.cuda.device_count()}" if args["device"] == "cuda" else "cpu"
    if device != "cpu":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    return device


def _rank_main(rank: int, world_size: int, args: dict, port: int, report) -> tuple | None:
    device = start_rank(rank, world_size, args, port)
    import torch
    import torch.distributed as dist

    import nodecomm

    on_gpu = device != "cpu"
    dtype = getattr(torch, args["dtype"])
    baseline_group = dist.new_group(backend="nccl") if args["baseline"] == "nccl" else None
    backend_group = None
    if BACKEND_ROW in args["paths"]:
        import nodecomm.distributed

        options = nodecomm.distributed.Options(socket=args["socket"], capacity_bytes=args["capacity_bytes"])
        backend_group = dist.new_group(backend="nodecomm", pg_options=options)
    rows, notes = [], []
    with nodecomm.connect(
        args["group"],
        rank,
        world_size,
        device=device,
        socket=args["socket"],
        timeout=60,
        nccl_group=baseline_group,
        capacity_bytes=args["capacity_bytes"],
    ) as comm:
        shared = None
        if "service" in args["paths"]:
            # The service path's inputs and outputs live in memory the daemon maps: no copies.
            shared = comm.service_buffer(2 * max(args["sizes"]) + 64)
            notes.append(_empty_submit_note(comm, world_size))
        paths = args["paths"]
        for index, nbytes in enumerate(args["sizes"]):
            count = nbytes // torch.tensor([], dtype=dtype).element_size()
            pattern = torch.arange(count, device=device) % 13
            x = (pattern + rank).to(dtype)
            expected = (pattern * world_size + world_size * (world_size - 1) // 2).to(dtype)
            del pattern
            iterations = iterations_for(nbytes)
            # Sizes alternate between the reverse order and the given one, so that no path is always
            # timed right after the same one (whatever that leaves behind: clocks, caches, copies).
            for path in paths if index % 2 else paths[::-1]:
                if path == "service":
                    x_in, out = shared.tensor(count, dtype), shared.tensor(count, dtype, -(-nbytes // 64) * 64)
                    x_in.copy_(x)
                    run = _operation(path, comm, dist, x_in, out, baseline_group)
                else:
                    out = torch.empty_like(x)
                    run = _operation(path, comm, dist, x, out, backend_group if path == BACKEND_ROW else baseline_group)
                # Graphs are captured as engines capture theirs: each shape warmed up eagerly first,
                # inside Communicator.capture(), whose first call of a size probes its paths.
                with comm.capture() if args["graph"] else contextlib.nullcontext():
                    for _ in range(min(5, iterations)):
                        run()
                    started = time.process_time(), time.perf_counter()
                    if on_gpu:
                        times = cuda_times(run, iterations, comm, args["graph"])
                    else:
                        times = host_times(run, iterations, comm)
                share = (time.process_time() - started[0]) / max(time.perf_counter() - started[1], 1e-9)
                slowest, wrong, share = slowest_rank(times, _flaws(path, out, expected), world_size, share)
                if rank == 0:
                    base, _, wire = path.partition("+")
                    variant = comm.path_variant(base, nbytes, wire or None) if base in NODECOMM_PATHS else ""
                    rows.append((nbytes, count, path, slowest, wrong, share, variant))
                    if args.get("progress"):
                        point = {"size_bytes": nbytes, "path": path, "p50_us": statistics.median(slowest) * 1e6}
                        print(json.dumps({"progress": point}), flush=True)
            if rank == 0:
                report([row for row in rows if row[0] == nbytes])  # shown as soon as measured
    dist.destroy_process_group()
    return (rows, notes) if rank == 0 else None


def _empty_submit_note(comm, world_size: int, iterations: int = 300) -> str:
    """What one service-path request costs on the control plane: collectives with nothing to move,
    submitted and waited for one at a time (the slowest rank per iteration)."""
    for _ in range(20):
        comm._service.empty_submit().wait()
    times = []
    for _ in range(iterations):
        comm.barrier()
        started = time.perf_counter()
        comm._service.empty_submit().wait()
        times.append(time.perf_counter() - started)
    slowest, _, _ = slowest_rank(times, 0, world_size)
    ordered = sorted(slowest)
    p99 = ordered[round(0.99 * (len(ordered) - 1))]
    return (
        f"service path control plane: an empty submit (gRPC round trip, matching, no data) costs "
        f"p50 {statistics.median(ordered) * 1e6:.1f} us, p99 {p99 * 1e6:.1f} us ({iterations} iterations)"
    )


def _row(nbytes: int, count: int, dtype: str, path: str, times: list[float], wrong: int, world_size: int,
         cpu_share: float, variant: str) -> Row:  # fmt: skip
    ordered = sorted(times)
    p50 = statistics.median(ordered)

    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    algbw = nbytes / p50 / 1e9 if p50 > 0 else 0.0
    busbw = algbw * (2 * (world_size - 1) / world_size) if world_size > 1 else 0.0
    return Row(
        nbytes, count, dtype, path, p50 * 1e6, quantile(0.99) * 1e6, algbw, busbw, wrong, len(times),
        quantile(0.25) * 1e6, quantile(0.75) * 1e6, cpu_share, variant,
    )  # fmt: skip


class PrivateDaemon:
    """A daemon on a temporary socket, for runs that are not pointed at a running one. It is a
    job's private daemon (nodecommd --private) whose lease this process holds: however this
    process ends, SIGKILL included, the daemon leaves within its grace and takes its directory."""

    def __init__(self, *flags: str, stored: Calibration | None = None) -> None:
        self.directory: str | None = None
        self.process: subprocess.Popen | None = None
        try:
            # Held: a directory made but not yet named here would be left, as would the file with
            # which Python's first gettempdir() tries the directory. Its sockets' paths must fit a
            # Unix socket's (108 bytes): a long TMPDIR gives way to /tmp.
            with interrupts_held():
                base = tempfile.gettempdir()
                self.directory = tempfile.mkdtemp(prefix="nodecomm-bench-", dir=base if len(base) < 60 else "/tmp")
            self.socket = os.path.join(self.directory, "nodecomm.sock")
            # A state directory and a cache of its own, empty but for `stored`: the machine's stored
            # calibration, or the user's cache, would make "auto" the calibrated table on one machine
            # and the built-in one on another. Its log goes there too: the bench's stderr is the user's.
            state, cache = os.path.join(self.directory, "state"), os.path.join(self.directory, "cache")
            flags = ("--private", "true", "--metrics-address", "off", "--log-level", "WARNING", *flags)
            if stored is not None:
                from nodecomm.service.calibration.stored import CalibrationStore

                CalibrationStore(state).save(stored)
            self.process = start_daemon(
                self.socket,
                "--state-dir",
                state,
                "--cache-dir",
                cache,
                *flags,
                own_session=True,
                log_path=os.path.join(self.directory, PRIVATE_LOG_NAME),
            )
            self.lease = JobLeaseHandle.take(lease_socket_path(self.socket), {})
        except BaseException:  # Ctrl-C included (start_daemon has reaped a daemon it started)
            if self.process is not None:
                self.process.kill()
                self.process.wait()  # before the removal: a daemon still running refills the directory
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)
            raise

    def __enter__(self) -> PrivateDaemon:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        try:
            self.process.terminate()
            self.process.wait(timeout=30)
        finally:  # also when it would not stop, or a second Ctrl-C came: killed, then removed
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self.lease.release()
            shutil.rmtree(self.directory, ignore_errors=True)


@dataclass
class BenchSetup:
    device: str  # "cpu" or "cuda"
    world_size: int
    dtype: str
    sizes: list[int]
    paths: list[str]  # nodecomm paths, "auto", and the baseline's name if it runs
    capacity_bytes: int = 8 << 20
    graph: bool = False
    gpus: int = 0  # GPUs the ranks spread over (0 on the CPU)
    progress: bool = False  # print each row as a JSON line once measured

    @property
    def baseline(self) -> str | None:
        name = BASELINES[self.device]
        return name if name in self.paths else None

    def describe(self) -> str:
        parts = [f"device={self.device}", f"world_size={self.world_size}", f"dtype={self.dtype}"]
        if self.device == "cuda":
            parts += [f"gpus={self.gpus}", f"ranks_per_gpu={-(-self.world_size // self.gpus)}"]
            parts.append("mode=graph" if self.graph else "mode=eager")
        return " ".join(parts)


def spawn_ranks(target, world_size: int, args: dict, on_part=None):
    """Run target(rank, world_size, args, port, report) in `world_size` spawned processes (tools/ranks.py)
    and return what rank 0 returns; the parts a rank reports go to on_part. The first rank to fail
    ends the run."""
    ranks = RankProcesses.start(target, world_size, world_size, args, free_port(), timeout=3600, report=True)
    try:
        result = ranks.values(on_part, first_failure=True)[0]
    except BaseException:
        ranks.close()  # interrupted or failed: the ranks go at once
        raise
    ranks.close(grace=60)
    return result


def run_ranks(
    target,
    world_size: int,
    args: dict,
    socket: str | None,
    daemon_flags: tuple[str, ...] = (),
    on_part=None,
    stored: Calibration | None = None,
):
    """spawn_ranks against `socket`, or a private daemon when None (args["socket"] is set), whose
    state directory holds `stored`."""
    # A group name of its own each run: nobody can know it beforehand to take it first.
    args = {**args, "group": f"bench-{secrets.token_hex(8)}"}
    if socket:
        return spawn_ranks(target, world_size, {**args, "socket": socket}, on_part)
    with PrivateDaemon(*daemon_flags, stored=stored) as daemon:
        return spawn_ranks(target, world_size, {**args, "socket": daemon.socket}, on_part)


def run_bench(setup: BenchSetup, socket: str | None, on_rows=None) -> tuple[list[Row], list[str]]:
    """The rows, and notes on what the rows do not show (the service path's per-request cost).
    on_rows(rows) is called with each size's rows as soon as they are measured."""
    shared = setup.device == "cuda" and setup.world_size > setup.gpus
    args = {
        "sizes": setup.sizes,
        "paths": setup.paths,
        "dtype": setup.dtype,
        "device": setup.device,
        "baseline": setup.baseline,
        "capacity_bytes": setup.capacity_bytes,
        "graph": setup.graph,
        "progress": setup.progress,
    }
    flags = ("--allow-shared-devices", "true") if shared else ()

    def rows_of(raw: list) -> list[Row]:
        raw = sorted(raw, key=lambda measured: (setup.sizes.index(measured[0]), setup.paths.index(measured[2])))
        return [_row(n, c, setup.dtype, p, t, w, setup.world_size, share, f) for n, c, p, t, w, share, f in raw]

    on_part = None if on_rows is None else (lambda raw: on_rows(rows_of(raw)))
    raw, notes = run_ranks(_rank_main, setup.world_size, args, socket, flags, on_part)
    return rows_of(raw), notes
