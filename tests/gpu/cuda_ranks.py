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
            for path in ("oneshot", "dma"):
                inplace = x.clone()
                comm.all_reduce(inplace, out=inplace, path=path)
                results[f"{path} in place"] = inplace
            # One element past an aligned start: no 8- or 16-byte loads of the caller's memory.
            shifted = torch.cat([x.new_zeros(1), x])[1:]
            results["oneshot unaligned"] = comm.all_reduce(shifted, path="oneshot")
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

        # The cases cover both variants of oneshot, by the rule the native group launches by.
        variants = {comm.path_variant("oneshot", count * DTYPES[name].itemsize) for name, count in cases}
        if variants != {"push", "pull"} or comm.path_variant("twoshot", 4) != "":
            problems.append(f"oneshot's variants over the cases: {sorted(variants)}, expected push and pull")

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


def drain_after_abort(
    rank: int, world_size: int, socket: str, calls: int, paths: list[str], report, leave=None
) -> dict:
    """Rank 1 joins and stays away; rank 0 enqueues `calls` all-reduces cycling `paths` ("oneshot"
    is pushed, "oneshot/pull" a size it pulls), each waiting for rank 1, and says so on `report`;
    the test then kills rank 1 or, given the `leave` event, sets it and rank 1 leaves (its process
    lives on): either aborts the group. Returns how long rank 0's stream took to drain after the
    abort was visible on the host."""
    device = device_for(rank)
    torch.cuda.set_device(device)
    with nodecomm.connect("drain", rank, world_size, device=device, socket=socket, timeout=120) as comm:
        small, pulled = torch.ones(1024, device=device), torch.ones(1 << 18, device=device)
        comm.all_reduce(small)
        torch.cuda.synchronize()
        if rank == 0:
            return _time_the_drain(comm, calls, [(small if p == "oneshot" else pulled, p.split("/")[0]) for p in paths],
                                   report)  # fmt: skip
        report.put("away")
        if leave is None:
            time.sleep(600)  # killed
        else:
            leave.wait(120)
    time.sleep(5)  # alive while rank 0 drains: no context of this process is torn down meanwhile
    return {}


def _time_the_drain(comm: nodecomm.Communicator, calls: int, cases: list, report) -> dict:
    for call in range(calls):
        x, path = cases[call % len(cases)]
        comm.all_reduce(x, out=x, path=path)
    report.put("queued")
    stream = torch.cuda.current_stream()
    # The waits below read host memory only: a CUDA call in a tight loop here would contend for
    # the driver's locks with the abort watch's write, which a real caller would not.
    deadline = time.monotonic() + 60
    while _native.abort_state(comm._control.address)[0] == 0 and time.monotonic() < deadline:
        pass
    if stream.query():
        return {"error": "the stream drained before the abort"}
    aborted = time.perf_counter()
    while _native.error_record(comm._control.address, 0)[0] == 0 and time.perf_counter() - aborted < 5:
        pass
    noticed = time.perf_counter()  # the waiting kernel put why it stopped on record
    stream.synchronize()
    drained = time.perf_counter()
    return {
        "drain_s": drained - aborted,
        "noticed_s": noticed - aborted,
        "reason": _native.abort_state(comm._control.address)[0],
        "record": _native.error_record(comm._control.address, 0)[0],
    }


def wait_alone(rank: int, world_size: int, socket: str, call: str) -> tuple[str, str]:
    """Rank 0 all-reduces (or enters a barrier); rank 1 joins but never calls. Rank 0's kernel
    must give up, and the call after it (the barrier itself) raise why."""
    device = device_for(rank)
    torch.cuda.set_device(device)
    with nodecomm.connect("alone", rank, world_size, device=device, socket=socket, timeout=120) as comm:
        if rank == 1:
            time.sleep(8.0)  # not a wait: the peer that never calls, past rank 0's kernel timeout
            return "idle", ""
        try:
            if call == "barrier":
                comm.barrier()  # returns or raises once the kernel gave up
                return "no error", ""
            comm.all_reduce(torch.ones(1024, device=device), path="oneshot")
            torch.cuda.synchronize()  # returns once the kernel times out
            comm.all_reduce(torch.ones(1024, device=device))
        except nodecomm.NodecommError as error:
            return type(error).__name__, str(error)
        return "no error", ""


def close_with_work_queued(rank: int, world_size: int, socket: str) -> list[str]:
    """Every rank queues a last all-reduce behind a long kernel on its stream (the delayed rank's
    the longest) and closes without synchronising: close must not leave before that work ran,
    or its Leave aborts the peers still waiting on its signals. Results are read afterwards."""
    device = device_for(rank)
    torch.cuda.set_device(device)
    count, dtype = 70_001, torch.bfloat16
    outputs = {}
    with nodecomm.connect("closing", rank, world_size, device=device, socket=socket, timeout=120) as comm:
        for path in PATHS:
            x = rank_input(rank, count, dtype, 7).to(device)
            torch.cuda._sleep(2_000_000_000 if rank == world_size - 1 else 100_000)  # ~1 s vs ~50 us
            outputs[path] = comm.all_reduce(x, path=path)
    expected = reference_sum(world_size, count, dtype, 7)
    return [f"{path}: {int((y.cpu() != expected).sum())} elements differ" for path, y in outputs.items()
            if not _same_bits(y, expected)]  # fmt: skip


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


def nccl_fallback(
    rank: int, world_size: int, socket: str, port: int, backend: str, calls: int, metrics: dict[str, float], url: str
) -> dict:
    """With an NCCL group (`backend` "nccl"; "gloo" where the ranks share one GPU, which NCCL
    refuses: its group takes CUDA tensors through the same torch.distributed call), the table's
    NCCL range runs through it from the native lane: a new output, forced, bfloat16 in place, and
    `calls` more for the lane's samples. The Python functions entered during one such call are
    recorded: the Communicator's all_reduce alone. Rank 0 then reads the daemon's `metrics` (series
    -> the value awaited) at `url` while the group is still there (its series go with it), for
    at most 15 s."""
    import sys
    import time
    import urllib.request

    import torch.distributed as dist

    device = device_for(rank)
    torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        with nodecomm.connect(
            "with-nccl", rank, world_size, device=device, socket=socket, timeout=120, nccl_group=dist.group.WORLD
        ) as comm:
            table = [(lo, hi, p.value) for lo, hi, p in comm.thresholds().rows()]
            total = float(world_size * (world_size + 1) // 2)
            x = torch.full((1 << 20,), float(rank + 1), device=device)  # 4 MiB: the NCCL range
            new = comm.all_reduce(x)
            forced = comm.all_reduce(x, path="nccl")
            half = torch.full((1 << 21,), float(rank + 1), device=device, dtype=torch.bfloat16)
            comm.all_reduce(half, out=half)
            entered: list[str] = []

            def profile(frame, event, _):
                if event == "call":
                    entered.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")

            sys.setprofile(profile)
            try:
                profiled = comm.all_reduce(x.clone())
            finally:
                sys.setprofile(None)
            for _ in range(calls):
                comm.all_reduce(x)
            torch.cuda.synchronize()
            seen: dict[str, float] = {}
            deadline = time.monotonic() + 15
            while rank == 0 and time.monotonic() < deadline:
                lines = urllib.request.urlopen(url, timeout=5).read().decode().splitlines()
                samples = (line.rpartition(" ") for line in lines if line and not line.startswith("#"))
                seen = {name: float(value) for name, _, value in samples}
                if all(seen.get(series, 0.0) >= value for series, value in metrics.items()):
                    break
                time.sleep(0.2)
            dist.barrier()  # rank 1 stays in the group until rank 0 has read
            return {
                "table": table,
                "exact": [bool((t == total).all()) for t in (new, forced, half, profiled)],
                "python": entered,
                "metrics": {series: seen.get(series, 0.0) for series in metrics},
            }
    finally:
        dist.destroy_process_group()


def candidates(source: int, stage: int, rows: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Source rank `source`'s [rows, topk] candidates at `stage`: any int32 index, and scores as
    arbitrary bits (NaN payloads, infinities, -0.0), on the CPU."""
    generator = torch.Generator().manual_seed(7919 * stage + source)
    idx = torch.randint(-(2**31), 2**31 - 1, (rows, topk), dtype=torch.int32, generator=generator)
    bits = torch.randint(-(2**31), 2**31 - 1, (rows, topk), dtype=torch.int32, generator=generator)
    return idx, bits.view(torch.float32)


def owner_table(rank: int, world_size: int, stage: int, rows: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What this rank must receive: [i, s, :] = source s's candidates for its i-th owned row."""
    from nodecomm.topk_layout import owned_rows

    span = owned_rows(rows, world_size, rank)
    sources = [candidates(s, stage, rows, topk) for s in range(world_size)]
    idx = torch.stack([c[0][span.start : span.stop] for c in sources], 1)
    scores = torch.stack([c[1][span.start : span.stop] for c in sources], 1)
    return idx, scores


def topk_exact(
    rank: int, world_size: int, socket: str, max_rows: int, topk: int, rows_list: list[int], delayed_rank: int
) -> list[str]:
    """CUDA top-k stages, eager back to back with no synchronisation between them, then one stage
    captured in a graph and replayed 8 times (the delayed rank sleeps on its GPU inside the graph):
    every owner table checked bit for bit."""
    device = device_for(rank)
    torch.cuda.set_device(device)
    problems = []
    with nodecomm.connect("topk-cuda", rank, world_size, device=device, socket=socket, timeout=120) as comm:
        exchange = comm.topk_exchange(max_rows, topk)
        tables = []
        for stage, rows in enumerate(rows_list):
            idx, scores = candidates(rank, stage, rows, topk)
            if rank == delayed_rank:
                torch.cuda._sleep(5_000_000)
            tables.append(exchange.stage(idx.to(device), scores.to(device)))
        torch.cuda.synchronize()
        for stage, (rows, (got_idx, got_scores)) in enumerate(zip(rows_list, tables, strict=True)):
            want_idx, want_scores = owner_table(rank, world_size, stage, rows, topk)
            if not (
                torch.equal(got_idx.cpu(), want_idx)
                and torch.equal(got_scores.cpu().view(torch.int32), want_scores.view(torch.int32))
            ):
                problems.append(f"eager stage {stage} rows={rows}: the owner table differs")

        rows = rows_list[0]
        static_idx = torch.empty((rows, topk), dtype=torch.int32, device=device)
        static_scores = torch.empty((rows, topk), dtype=torch.float32, device=device)
        graph = torch.cuda.CUDAGraph()
        capture_stream = torch.cuda.Stream()
        capture_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(capture_stream), torch.cuda.graph(graph, stream=capture_stream):
            if rank == delayed_rank:
                torch.cuda._sleep(20_000_000)  # ~10 ms of GPU cycles, inside the graph
            out_idx, out_scores = exchange.stage(static_idx, static_scores)
        history = []
        for replay in range(8):
            idx, scores = candidates(rank, 100 + replay, rows, topk)
            static_idx.copy_(idx)
            static_scores.copy_(scores)
            graph.replay()
            history.append((out_idx.clone(), out_scores.clone()))
        torch.cuda.synchronize()
        for replay, (got_idx, got_scores) in enumerate(history):
            want_idx, want_scores = owner_table(rank, world_size, 100 + replay, rows, topk)
            if not (
                torch.equal(got_idx.cpu(), want_idx)
                and torch.equal(got_scores.cpu().view(torch.int32), want_scores.view(torch.int32))
            ):
                problems.append(f"graph replay {replay}: the owner table differs")
        comm.barrier()
        record = _native.error_record(comm._control.address, rank)
        if record[0] != 0:
            problems.append(f"error record {record}")
    return problems


def topk_large_offsets(rank: int, world_size: int, socket: str, rows_per_owner: int, topk: int) -> int:
    """An exchange whose slab offsets pass 2^31 bytes (slot 1's score plane starts past 3 planes):
    candidates are a function of (source, row, column), so a truncated offset shows as a wrong
    value; returns how many elements differ, counted on the GPU."""
    device = device_for(rank)
    torch.cuda.set_device(device)
    rows = rows_per_owner * world_size
    with nodecomm.connect("topk-large", rank, world_size, device=device, socket=socket, timeout=300) as comm:
        exchange = comm.topk_exchange(rows, topk)
        row = torch.arange(rows, device=device, dtype=torch.int32).view(-1, 1)
        column = torch.arange(topk, device=device, dtype=torch.int32).view(1, -1)

        def value(source, r, c):
            return r * 4099 + c * 31 + source * 7

        idx = value(rank, row, column)
        scores = (idx ^ 0x5BD1E995).view(torch.float32)
        del row
        wrong = 0
        for _ in range(2):  # stage 1 uses slot 1 (past 2 GiB), stage 2 slot 0
            got_idx, got_scores = exchange.stage(idx, scores)
            owned = torch.arange(rank * rows_per_owner, (rank + 1) * rows_per_owner, device=device, dtype=torch.int32)
            source = torch.arange(world_size, device=device, dtype=torch.int32).view(1, -1, 1)
            want = value(source, owned.view(-1, 1, 1), column.view(1, 1, -1))
            wrong += int((got_idx != want).sum()) + int((got_scores.view(torch.int32) != (want ^ 0x5BD1E995)).sum())
            del got_idx, got_scores, want
        torch.cuda.synchronize()
    return wrong


def service_without_host_sync(rank: int, world_size: int, socket: str, calls: int) -> dict:
    """Behind a ~1 s kernel on this rank's stream, queue `calls` in-place service all-reduces of a
    value in service memory and wait() on every one: the waits return while the stream is still
    busy (the daemon answers once it has enqueued, and the stream waits on its event), and the
    value, read after one synchronisation, is what `calls` rounds of summing give."""
    device = device_for(rank)
    torch.cuda.set_device(device)
    with nodecomm.connect("nosync", rank, world_size, device=device, socket=socket, timeout=60) as comm:
        buffer = comm.service_buffer(4096)
        value = buffer.tensor(1, torch.float32)
        value.fill_(1.0)
        comm.all_reduce(value, out=value, path="service")  # warm: events opened, stream made
        torch.cuda.synchronize()
        value.fill_(1.0)
        torch.cuda._sleep(2_000_000_000)
        started = time.monotonic()
        works = [comm.all_reduce(value, out=value, path="service", async_op=True) for _ in range(calls)]
        for work in works:
            work.wait()
        waited = time.monotonic() - started
        busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        return {"waited_s": waited, "stream_busy_after_waits": busy, "value": value.item()}


def _disagreeing_call(comm, case: str, odd: bool, device: str):
    """(call, the sentinel-filled output it may write) of `case` for rank 1 (odd) or the others."""

    def reduce(count: int, path: str | None, dtype: torch.dtype = torch.float32, wire: str = "lossless"):
        out = torch.full((count,), -7.0, dtype=dtype, device=device)
        x = torch.ones(count, dtype=dtype, device=device)
        return (lambda: comm.all_reduce(x, out=out, path=path, wire=wire)), out

    def gather(nbytes: int):
        out = torch.full((comm.world_size, nbytes), 7, dtype=torch.uint8, device=device)
        return (lambda: comm.all_gather(torch.ones(nbytes, dtype=torch.uint8, device=device), out=out)), out

    def stage(rows: int):
        exchange = comm.topk_exchange(max_rows=16, topk=4)
        idx, scores = torch.zeros(rows, 4, dtype=torch.int32, device=device), torch.zeros(rows, 4, device=device)
        return (lambda: exchange.stage(idx, scores)), None  # its tables are new tensors

    def norm(rows: int, hidden: int, path: str):
        out = torch.full((rows, hidden), -7.0, device=device)
        x, residual = torch.ones(rows, hidden, device=device), torch.ones(rows, hidden, device=device)
        weight = torch.ones(hidden, device=device)
        return (lambda: comm.all_reduce_rms_norm(x, residual, weight, 1e-6, out=out, path=path)), out

    pulled, large = 300_000, (1 << 20)
    pieces = 5 * (1 << 20)  # 20 MiB of float32: three slot-sized pieces of the default 8 MiB
    usual, unusual = {
        "count_pushed": (lambda: reduce(4096, "oneshot"), lambda: reduce(4100, "oneshot")),
        "count_pulled": (lambda: reduce(pulled, "oneshot"), lambda: reduce(pulled + 1, "oneshot")),
        "count_twoshot": (lambda: reduce(pulled, "twoshot"), lambda: reduce(pulled + 1, "twoshot")),
        "count_dma": (lambda: reduce(large, "dma"), lambda: reduce(large + 1, "dma")),
        "count_pieces": (lambda: reduce(pieces, "twoshot"), lambda: reduce(pieces + (1 << 20), "twoshot")),
        "count_zero": (lambda: reduce(16, "oneshot"), lambda: reduce(0, "oneshot")),
        "dtype": (lambda: reduce(64, "oneshot"), lambda: reduce(64, "oneshot", torch.float16)),
        "dtype_same_bytes": (
            lambda: reduce(64, "oneshot", torch.bfloat16),
            lambda: reduce(64, "oneshot", torch.float16),
        ),
        "path_pushed_twoshot": (lambda: reduce(4096, "oneshot"), lambda: reduce(4096, "twoshot")),
        "path_pushed_dma": (lambda: reduce(4096, "oneshot"), lambda: reduce(4096, "dma")),
        "path_pulled_twoshot": (lambda: reduce(pulled, "oneshot"), lambda: reduce(pulled, "twoshot")),
        "path_twoshot_dma": (lambda: reduce(pulled, "twoshot"), lambda: reduce(pulled, "dma")),
        "wire_pushed": (lambda: reduce(4096, "oneshot"), lambda: reduce(4096, "oneshot", wire="int8")),
        "wire_twoshot": (
            lambda: reduce(pulled, "twoshot", wire="int8"),
            lambda: reduce(pulled, "twoshot", wire="fp8"),
        ),
        "wire_dma": (lambda: reduce(large, "dma", wire="fp8"), lambda: reduce(large, "dma")),
        "collective": (lambda: reduce(16, "oneshot"), lambda: gather(64)),
        "barrier": (lambda: reduce(16, "oneshot"), lambda: (comm.barrier, None)),
        "gather_bytes": (lambda: gather(16), lambda: gather(20)),
        "topk_rows": (lambda: stage(8), lambda: stage(12)),
        "norm_shape_oneshot": (lambda: norm(4, 1024, "oneshot"), lambda: norm(8, 512, "oneshot")),
        "norm_shape_twoshot": (lambda: norm(4, 1024, "twoshot"), lambda: norm(8, 512, "twoshot")),
    }[case]
    return (unusual if odd else usual)()


def disagree(rank: int, world_size: int, socket: str, cases: list[str]) -> dict:
    """Rank 1 disagrees with the others on one call per case, each in a group of its own: every
    rank's next call raises GroupMismatchError (the group is aborted), no output is written, and
    the communicator still closes. Returns case -> (class, message, untouched, raised again)."""
    device = device_for(rank)
    torch.cuda.set_device(device)
    outcome = {}
    for case in cases:
        with nodecomm.connect(f"disagree-{case}", rank, world_size, device=device, socket=socket, timeout=120) as comm:
            call, out = _disagreeing_call(comm, case, rank == 1, device)
            error = None
            try:
                call()
                torch.cuda.synchronize()
                comm.all_reduce(torch.ones(16, device=device))  # the next call raises
            except nodecomm.NodecommError as raised:
                error = raised
            torch.cuda.synchronize()
            untouched = out is None or bool((out == (7 if out.dtype == torch.uint8 else -7.0)).all())
            try:
                comm.all_reduce(torch.ones(16, device=device))
                again = False
            except nodecomm.GroupMismatchError:
                again = True
            name, message = (type(error).__name__, str(error)) if error else ("no error", "")
            outcome[case] = (name, message, untouched, again)
    return outcome


def isolated_rank(rank: int, world_size: int, socket: str) -> dict:
    """A rank in mount and IPC namespaces of its own (tests/gpu/test_isolated_cuda.py): every
    kernel path and the service path, against the reference. Returns the kernel paths' problems,
    the service path's outcome ("exact", "wrong: ...", or the error), and, from rank 0, the
    group's service ordering as `nodecomm status --json` shows it."""
    import contextlib
    import io
    import json

    from nodecomm.tools.cli import main as nodecomm_cli

    device = device_for(rank)
    torch.cuda.set_device(device)
    problems, service, shown = [], "exact", None
    with nodecomm.connect("isolated", rank, world_size, device=device, socket=socket, timeout=60) as comm:
        for seed, (dtype_name, count) in enumerate([("float32", 4096), ("bfloat16", 70_001), ("float32", 1 << 20)]):
            dtype = DTYPES[dtype_name]
            x = rank_input(rank, count, dtype, seed).to(device)
            expected = reference_sum(world_size, count, dtype, seed)
            for path in PATHS:
                if not _same_bits(comm.all_reduce(x, path=path), expected):
                    problems.append(f"{path} {dtype_name} count={count} differs from the reference")
            if service != "exact":
                continue
            try:
                y = comm.all_reduce(x, path="service")
                torch.cuda.synchronize()
            except nodecomm.NodecommError as error:
                service = f"{type(error).__name__}: {error}"
                continue
            if not _same_bits(y, expected):
                service = f"wrong: service {dtype_name} count={count} differs from the reference"
        if rank == 0:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                nodecomm_cli(["--socket", socket, "status", "--json"])
            groups = json.loads(printed.getvalue())["groups"]
            shown = next(g["service_ordering"] for g in groups if g["name"] == "isolated")
        comm.barrier()
        torch.cuda.synchronize()
    return {"problems": problems, "service": service, "ordering": shown}


def done_word_after_a_peer_leaves(rank: int, world_size: int, socket: str) -> dict:
    """Rank 0's stream waits on its service "done" word for a value the daemon will never write
    (as it would behind a daemon stream held up by a rank that died); rank 1 leaves. The abort must
    raise the word, so that rank 0's stream runs on: polled for 15 s (then written here, so that the process can end)."""
    device = device_for(rank)
    torch.cuda.set_device(device)
    with nodecomm.connect("done-word", rank, world_size, device=device, socket=socket, timeout=60) as comm:
        comm.all_reduce(torch.ones(16, device=device))  # both ranks are in
        torch.cuda.synchronize()
        if rank == 1:
            time.sleep(2.0)  # rank 0's wait is queued before the abort
            return {}
        done = comm._transport.service_words[1]
        never = 1 << 40  # what the daemon's stream would write after 2^40 collectives
        _native.cuda_wait_word(torch.cuda.current_stream().cuda_stream, done, never)
        marker = torch.zeros(1, device=device)
        marker.fill_(1.0)  # runs only once the wait is over
        deadline = time.monotonic() + 15.0
        while not torch.cuda.current_stream().query() and time.monotonic() < deadline:
            time.sleep(0.05)
        ran_on = torch.cuda.current_stream().query()
        seen = {"stream_ran_on": ran_on, "abort": _native.abort_state(comm._control.address)[0] != 0}
        if not ran_on:  # let the process end: write the word here
            _native.cuda_write_word_now(torch.cuda.current_device(), done, never)
        torch.cuda.synchronize()
        return {**seen, "marker": marker.item()}


def probed_paths() -> dict[int, str]:
    """The path each captured size's probe chose, filled in as the client logs "captured size probed"."""
    import logging

    chosen: dict[int, str] = {}

    class Probes(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage() == "captured size probed":
                chosen[record.bytes] = record.path

    logging.getLogger("nodecomm.client").addHandler(Probes())
    logging.getLogger("nodecomm.client").setLevel(logging.INFO)
    return chosen


def probed_captures(
    rank: int, world_size: int, socket: str, counts: list[int], norm: tuple[int, int], report, commands
) -> dict:
    """As an engine captures: inside comm.capture(), each size warmed up by one eager call (which
    probes its paths) and then captured, 3 calls per graph; every graph replayed twice after the
    phase and its output compared bit for bit with the reference; the same for one fused
    all_reduce_rms_norm of `norm` (rows, hidden), whose warm-up probes its size and whose replays
    are compared with that warm-up's outputs; the captured sizes flushed to the daemon, then
    "sent" reported and the group held until the test sends "stop". Returns the problems and the
    path each size's probe chose (from the client's log)."""
    device = device_for(rank)
    torch.cuda.set_device(device)
    chosen = probed_paths()
    problems, graphs = [], []
    with nodecomm.connect("probed", rank, world_size, device=device, socket=socket, timeout=120) as comm:
        with comm.capture():
            for seed, count in enumerate(counts):
                x = rank_input(rank, count, torch.bfloat16, seed).to(device)
                expected = reference_sum(world_size, count, torch.bfloat16, seed)
                out = torch.empty_like(x)
                if not _same_bits(comm.all_reduce(x, out=out), expected):
                    problems.append(f"the warm-up of {count} elements differs from the reference")
                graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.graph(graph, stream=stream):
                    for _ in range(3):
                        comm.all_reduce(x, out=out)
                graphs.append((graph, x, out, expected, count))  # x too: the graph reads its memory
            rows, hidden = norm
            x = rank_input(rank, rows * hidden, torch.bfloat16, len(counts)).to(device).view(rows, hidden)
            residual, weight = torch.ones_like(x), torch.full((hidden,), 0.5, dtype=x.dtype, device=device)
            out, residual_out = torch.empty_like(x), torch.empty_like(x)

            def fused() -> None:
                comm.all_reduce_rms_norm(x, residual, weight, 1e-6, out=out, residual_out=residual_out)

            fused()  # the warm-up: probes the size
            warm = (out.clone(), residual_out.clone())
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(3):
                    fused()
            norm_graph = (graph, x, residual, weight, out, residual_out, warm)
        for _ in range(2):
            graph, *_, out, residual_out, warm = norm_graph
            out.zero_()
            residual_out.zero_()
            graph.replay()
            if not (_same_bits(out, warm[0]) and _same_bits(residual_out, warm[1])):
                problems.append("a replay of the fused norm differs from its warm-up")
            for graph, _, out, expected, count in graphs:
                out.zero_()
                graph.replay()
                if not _same_bits(out, expected):
                    problems.append(f"a replay of {count} elements differs from the reference")
        comm._session.flush()
        report.put("sent")
        assert commands[rank].get(timeout=120) == "stop"
    return {"problems": problems, "chosen": chosen}


def probed_beside_another_capture(rank: int, world_size: int, socket: str, count: int) -> dict:
    """A size's warm-up inside comm.capture(), then eager calls past the timing sample period (the
    lane queries its sampled calls' events), while another thread of the rank holds a graph capture
    open in torch's default global mode, which refuses every other thread's allocations, waits and
    event queries: the probe runs anyway (its thread relaxed), the lane reads its timings relaxed,
    every result is the reference's, and the other capture is not broken: its replay adds what it
    captured. Returns the problems and the path the probe chose (from the client's log)."""
    import threading

    device = device_for(rank)
    torch.cuda.set_device(device)
    chosen = probed_paths()
    problems: list[str] = []
    began, probed = threading.Event(), threading.Event()
    other: dict[str, object] = {}

    def capture_meanwhile() -> None:  # the engine's other thread
        torch.cuda.set_device(device)
        y, graph, stream = torch.zeros(1024, device=device), torch.cuda.CUDAGraph(), torch.cuda.Stream()
        try:
            with torch.cuda.graph(graph, stream=stream):  # capture_error_mode="global"
                y.add_(1)
                began.set()
                if not probed.wait(timeout=120):
                    other["error"] = "the probe did not finish in 120 s"
                y.add_(1)
            graph.replay()
            torch.cuda.synchronize()
            other["y"] = y.cpu()
        except Exception as error:  # reported below, with the probe's
            other["error"] = repr(error)
        finally:
            began.set()

    with nodecomm.connect("beside", rank, world_size, device=device, socket=socket, timeout=120) as comm:
        x = rank_input(rank, count, torch.bfloat16, 0).to(device)
        out = torch.empty_like(x)
        expected = reference_sum(world_size, count, torch.bfloat16, 0)
        eager = [torch.empty_like(x) for _ in range(2 * 64 + 8)]  # the daemon's timing_sample_period: 64
        torch.cuda.synchronize()
        thread = threading.Thread(target=capture_meanwhile, daemon=True)
        thread.start()
        if not began.wait(timeout=120):
            problems.append("the other thread's capture did not begin in 120 s")
        try:
            with comm.capture():
                comm.all_reduce(x, out=out)  # the size's warm-up: probes its paths
            for output in eager:  # sampled ones among them, whose events later calls query
                comm.all_reduce(x, out=output)
        except Exception as error:
            problems.append(f"an all-reduce beside the other capture raised {error!r}")
        probed.set()
        thread.join(timeout=120)
        if thread.is_alive():
            problems.append("the other thread's capture did not end in 120 s")
        elif "error" in other:
            problems.append(f"the other thread's capture failed: {other['error']}")
        elif not torch.equal(other["y"], torch.full((1024,), 2.0)):
            problems.append(f"the other thread's replay left {other['y'][:4].tolist()}..., not 2.0")
        if not all(_same_bits(result, expected) for result in [out, *eager]):
            problems.append("an all-reduce's result differs from the reference")
    return {"problems": problems, "chosen": chosen}
