"""Rank programs the tests run in separate processes (importable by spawned children)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time

import torch

import nodecomm
from waiting import wait_until

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def rank_input(rank: int, count: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank `rank`'s input: random normals scaled per rank, so the rank order of the sum matters."""
    base = torch.randn(count, generator=torch.Generator().manual_seed(seed))
    return (base * (1.0 + rank / 7.0) + rank * 1e-3).to(dtype)


def reference_sum(world_size: int, count: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """fp32 accumulation in rank order 0..n-1, rounded once."""
    acc = rank_input(0, count, dtype, seed).float()
    for rank in range(1, world_size):
        acc += rank_input(rank, count, dtype, seed).float()
    return acc.to(dtype)


def all_reduce_cases(rank: int, world_size: int, socket: str, cases: list[tuple[str, int]]) -> list[str]:
    """Run every (dtype, count) case through both algorithms; return the mismatches found."""
    problems = []
    with nodecomm.connect("exact", rank, world_size, socket=socket, timeout=60) as comm:
        for index, (dtype_name, count) in enumerate(cases):
            dtype = DTYPES[dtype_name]
            x = rank_input(rank, count, dtype, seed=index)
            expected = reference_sum(world_size, count, dtype, seed=index).view(BITS[dtype])
            results = {}
            for path in ("oneshot", "twoshot", None):
                y = comm.all_reduce(x, path=path)
                results[path] = y
                if not torch.equal(y.view(BITS[dtype]), expected):
                    wrong = int((y.view(BITS[dtype]) != expected).sum())
                    problems.append(
                        f"{dtype_name} count={count} path={path}: {wrong} elements differ from the reference"
                    )
            if not torch.equal(x, rank_input(rank, count, dtype, seed=index)):
                problems.append(f"{dtype_name} count={count}: the input was modified")
            inplace = x.clone()
            comm.all_reduce(inplace, out=inplace, path="twoshot")
            if not torch.equal(inplace.view(BITS[dtype]), expected):
                problems.append(f"{dtype_name} count={count}: in-place twoshot differs")
    return problems


def norm_inputs(rank: int, rows: int, hidden: int, dtype: torch.dtype, seed: int):
    """(x, residual, weight) of an all_reduce_rms_norm case: x this rank's, the others the same on
    every rank."""
    x = rank_input(rank, rows * hidden, dtype, seed).view(rows, hidden)
    residual = rank_input(0, rows * hidden, dtype, seed + 1000).view(rows, hidden)
    return x, residual, rank_input(0, hidden, dtype, seed + 2000)


def digest(tensor: torch.Tensor) -> str:
    """The tensor's bytes, hashed: bits compared without sending them back."""
    flat = tensor.detach().cpu().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy() if flat.numel() else b"").hexdigest()[:16]


def rms_norm_cases(
    rank: int, world_size: int, socket: str, cases: list[tuple[str, int, int, list]], device: str = "cpu",
    graph: bool = False,
) -> dict[str, tuple[str, str]]:  # fmt: skip
    """Every (dtype, rows, hidden, paths) case through all_reduce_rms_norm on each path (None: the
    table's; "inplace": the table's with out=x, residual_out=residual), eager or (CUDA, graph)
    captured and replayed: {"dtype rows x hidden path": (digest of out, digest of residual_out)},
    and "... input" entries where an input was modified."""
    results = {}
    with nodecomm.connect(
        "norm", rank, world_size, socket=socket, device=rank_device(rank, device), timeout=60
    ) as comm:
        for index, (dtype_name, rows, hidden, paths) in enumerate(cases):
            dtype = DTYPES[dtype_name]
            x, residual, weight = (t.to(comm.device) for t in norm_inputs(rank, rows, hidden, dtype, index))
            for path in paths:
                name = f"{dtype_name} {rows}x{hidden} {path}"
                inplace = path == "inplace"
                a, b = (x.clone(), residual.clone()) if inplace else (x, residual)
                kwargs = dict(out=a, residual_out=b) if inplace else dict(path=path)
                if graph:
                    out, residual_out = torch.empty_like(x), torch.empty_like(x)
                    if not inplace:
                        kwargs.update(out=out, residual_out=residual_out)
                    comm.all_reduce_rms_norm(a, b, weight, 1e-6, **kwargs)  # warm up outside the capture
                    if inplace:
                        a.copy_(x), b.copy_(residual)
                    captured = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(captured):
                        comm.all_reduce_rms_norm(a, b, weight, 1e-6, **kwargs)
                    if inplace:
                        a.copy_(x), b.copy_(residual)
                    else:
                        out.zero_(), residual_out.zero_()
                    captured.replay()
                    results[name] = (digest(a if inplace else out), digest(b if inplace else residual_out))
                else:
                    out, residual_out = comm.all_reduce_rms_norm(a, b, weight, 1e-6, **kwargs)
                    results[name] = (digest(out), digest(residual_out))
            if not (torch.equal(x.cpu(), norm_inputs(rank, rows, hidden, dtype, index)[0])):
                results[f"{dtype_name} {rows}x{hidden} input"] = ("modified", "")
    return results


def gather_and_barrier(rank: int, world_size: int, socket: str) -> list[str]:
    problems = []
    with nodecomm.connect("gather", rank, world_size, socket=socket, timeout=60) as comm:
        for count in (0, 1, 5, (3 << 20) + 1):
            x = torch.full((count,), rank, dtype=torch.int32).view(torch.float32)  # rank-filled payload
            out = comm.all_gather(x)
            expected = torch.arange(world_size, dtype=torch.int32).repeat_interleave(count).view(world_size, count)
            if not torch.equal(out.view(torch.int32), expected):
                problems.append(f"all_gather count={count} misrouted")
        for _ in range(50):
            comm.barrier()
    return problems


def wait_joined(socket: str, group: str, joined: list[int], timeout: float = 60.0) -> None:
    """Until the daemon shows `joined` (exactly those ranks) waiting in forming group `group`: how a
    test orders its ranks' arrivals without sleeping. Fails after `timeout` s, saying what it saw."""
    import grpc

    from nodecomm.socket_path import grpc_target
    from nodecomm.v1 import control_pb2 as pb
    from nodecomm.v1 import control_pb2_grpc as pb_grpc

    deadline, seen = time.monotonic() + timeout, None
    with grpc.insecure_channel(grpc_target(socket)) as channel:
        stub = pb_grpc.ControlStub(channel)
        while time.monotonic() < deadline:
            groups = stub.ListGroups(pb.ListGroupsRequest(), timeout=10).groups
            seen = [sorted(g.joined_ranks) for g in groups if g.name == group and g.state == "joining"]
            if seen == [sorted(joined)]:
                return
            time.sleep(0.01)
    raise AssertionError(f"group {group!r}: ranks {joined} never waited there together within {timeout} s (saw {seen})")


def join_only(rank: int, world_size: int, socket: str, group: str, kwargs: dict) -> str:
    with nodecomm.connect(group, rank, world_size, socket=socket, timeout=kwargs.pop("timeout", 20), **kwargs) as comm:
        y = comm.all_reduce(torch.ones(4))
        return f"ok {y.tolist()}"


def reduce_until_error(rank: int, world_size: int, socket: str, group: str, report) -> tuple[str, str, float]:
    """All-reduce in a loop until something fails; returns (error class, message, time of failure)."""
    with nodecomm.connect(group, rank, world_size, socket=socket, timeout=30) as comm:
        x = torch.ones(1 << 16)
        comm.all_reduce(x)
        report.put(("running", rank))
        try:
            while True:
                comm.all_reduce(x)
        except nodecomm.NodecommError as error:
            return type(error).__name__, str(error), time.time()


def survive_daemon_restart(rank: int, world_size: int, socket: str, commands, report) -> dict:
    outcome = {}
    comm = nodecomm.connect("restart", rank, world_size, socket=socket, timeout=30)
    outcome["before"] = comm.all_reduce(torch.full((8,), float(rank + 1))).tolist()
    report.put(("connected", rank))
    assert commands.get(timeout=60) == "daemon restarted"
    try:
        outcome["after_restart"] = comm.all_reduce(torch.full((8,), float(rank + 2))).tolist()
    except nodecomm.NodecommError as error:
        outcome["after_restart"] = f"{type(error).__name__}: {error}"
    comm.close()
    with nodecomm.connect("restart", rank, world_size, socket=socket, timeout=30) as again:
        outcome["reconnected"] = again.all_reduce(torch.full((8,), float(rank + 1))).tolist()
    return outcome


def stall_peer(rank: int, world_size: int, socket: str) -> tuple[str, str, float]:
    """Rank 0 all-reduces; rank 1 never does (a broken barrier): rank 0 must time out."""
    with nodecomm.connect("stall", rank, world_size, socket=socket, timeout=30) as comm:
        if rank == 1:
            time.sleep(6)  # not a wait: the stalled peer itself, past rank 0's operation timeout
            return "slept", "", 0.0
        started = time.monotonic()
        try:
            comm.all_reduce(torch.ones(16))
        except nodecomm.NodecommError as error:
            return type(error).__name__, str(error), time.monotonic() - started
        return "no error", "", time.monotonic() - started


def abort_under_a_call(rank: int, world_size: int, socket: str) -> tuple[str, float]:
    """Rank 0 all-reduces while rank 1 stays away, and aborts the group from another thread a
    second later; rank 1 then calls. Each rank's error, and on rank 0 how long its call took."""
    import threading

    with nodecomm.connect("abort", rank, world_size, socket=socket, timeout=30, operation_timeout=20) as comm:
        comm.barrier()
        if rank == 1:
            time.sleep(3)  # not a wait: away until rank 0 has aborted the group
            started = time.monotonic()
        else:
            threading.Timer(1.0, comm.abort).start()
            started = time.monotonic()
        try:
            comm.all_reduce(torch.ones(16))
        except nodecomm.NodecommError as error:
            return f"{type(error).__name__}: {error}", time.monotonic() - started
        return "no error", time.monotonic() - started


class _Marked(torch.Tensor):
    """A tensor subclass (which may redefine any operation): left to the Python checks."""


def misuse(rank: int, world_size: int, socket: str) -> dict:
    """Bad calls on a live communicator: each must raise a clear InvalidArgumentError."""
    seen = {}
    with nodecomm.connect("misuse", rank, world_size, socket=socket, timeout=30, dtypes=("float32",)) as comm:
        calls = {
            "dtype": lambda: comm.all_reduce(torch.ones(4, dtype=torch.float16)),
            "not_tensor": lambda: comm.all_reduce([1.0, 2.0]),
            "strided": lambda: comm.all_reduce(torch.ones(8)[::2]),
            "out_shape": lambda: comm.all_reduce(torch.ones(4), out=torch.empty(5)),
            "path": lambda: comm.all_reduce(torch.ones(4), path="teleport"),
            "gpu_path": lambda: comm.all_reduce(torch.ones(4), path="dma"),
        }
        for name, call in calls.items():
            try:
                call()
                seen[name] = "no error"
            except nodecomm.InvalidArgumentError as error:
                seen[name] = str(error)
        seen["still_works"] = comm.all_reduce(torch.ones(4)).tolist()
        # The native call takes the common case and leaves everything above to the Python checks.
        declined = {
            "dtype": (torch.ones(4, dtype=torch.float16), None),
            "strided": (torch.ones(8)[::2], None),
            "out_shape": (torch.ones(4), torch.empty(5)),
            "out_dtype": (torch.ones(4), torch.empty(4, dtype=torch.float64)),
            "subclass": (torch.ones(4).as_subclass(_Marked), None),
            "empty": (torch.ones(0), None),
        }
        seen["native_declines"] = sorted(name for name, (t, o) in declined.items() if comm._tensor_call(t, o) is None)
        out = torch.empty(4)
        seen["native_runs"] = comm._tensor_call(torch.ones(4), out) is out and out.tolist() == [2.0] * 4
        seen["table"] = [(lo, hi, p.value) for lo, hi, p in comm.thresholds().rows()]
    try:
        comm.all_reduce(torch.ones(4))
        seen["closed"] = "no error"
    except nodecomm.InvalidArgumentError as error:
        seen["closed"] = str(error)
    comm.close()  # twice is harmless
    return seen


def candidates(world_size: int, rows: int, topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's top-k candidates, [world_size, rows, topk]: int32 indices and float32 scores
    built from arbitrary int32 bit patterns (NaN payloads and -0.0 included)."""
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(-(2**31), 2**31 - 1, (world_size, rows, topk), generator=generator, dtype=torch.int32)
    bits = torch.randint(-(2**31), 2**31 - 1, (world_size, rows, topk), generator=generator, dtype=torch.int32)
    bits[..., 0] = -(2**31)  # -0.0
    return idx, bits.view(torch.float32)


def topk_exchange_cases(rank: int, world_size: int, socket: str, max_rows: int, topk: int, rows_list: list[int]):
    """Stage every case; the owner table must equal, bit for bit, the reference built from every
    rank's inputs. Returns the problems found."""
    from nodecomm.topk_layout import owned_rows

    problems = []
    with nodecomm.connect("topk", rank, world_size, socket=socket, timeout=60) as comm:
        exchange = comm.topk_exchange(max_rows, topk)
        for seed, rows in enumerate(rows_list):
            idx, scores = candidates(world_size, rows, topk, seed)
            got_idx, got_scores = exchange.stage(idx[rank], scores[rank])
            span = owned_rows(rows, world_size, rank)
            want_idx = idx[:, span.start : span.stop].permute(1, 0, 2)
            want_bits = scores[:, span.start : span.stop].permute(1, 0, 2).view(torch.int32)
            if got_idx.shape != (len(span), world_size, topk) or not torch.equal(got_idx, want_idx):
                problems.append(f"rows={rows}: index table differs (shape {tuple(got_idx.shape)})")
            if got_scores.dtype != torch.float32 or not torch.equal(got_scores.view(torch.int32), want_bits):
                problems.append(f"rows={rows}: score bits differ")
    return problems


def topk_mismatch(rank: int, world_size: int, socket: str) -> dict:
    """Rank 1 asks for a different topk: every rank fails, nothing is allocated; the next exchange
    with agreeing geometry works."""
    import grpc

    from nodecomm.socket_path import grpc_target
    from nodecomm.v1 import control_pb2 as pb
    from nodecomm.v1 import control_pb2_grpc as pb_grpc

    def reserved() -> int:
        with grpc.insecure_channel(grpc_target(socket)) as channel:
            groups = pb_grpc.ControlStub(channel).ListGroups(pb.ListGroupsRequest(), timeout=10).groups
        return next(g.reserved_bytes for g in groups if g.name == "topk-mismatch")

    seen = {}
    with nodecomm.connect("topk-mismatch", rank, world_size, socket=socket, timeout=60) as comm:
        comm.barrier()
        seen["before"] = reserved()
        try:
            comm.topk_exchange(8, 16 if rank != 1 else 8, timeout=30)
            seen["error"] = "no error"
        except nodecomm.NodecommError as error:
            seen["error"] = f"{type(error).__name__}: {error}"
        comm.barrier()
        seen["after_failure"] = reserved()
        exchange = comm.topk_exchange(8, 4, timeout=30)
        idx, scores = candidates(world_size, 8, 4, seed=7)
        got, _ = exchange.stage(idx[rank], scores[rank])
        seen["staged_rows"] = got.shape[0]
        comm.barrier()
        seen["after_success"] = reserved()
    return seen


def table_with(rank: int, world_size: int, socket: str, thresholds: dict) -> list[tuple[str, str, str]]:
    """The dispatch table a group formed with these per-group overrides gets."""
    with nodecomm.connect("overridden", rank, world_size, socket=socket, timeout=30, thresholds=thresholds) as comm:
        comm.all_reduce(torch.ones(4))
        return [(lo, hi, p.value) for lo, hi, p in comm.thresholds().rows()]


def live_switch(rank: int, world_size: int, socket: str, synthetic: list, calls: int, device: str = "cpu") -> dict:
    """Stream synthetic timings, then all-reduce `calls` times; report at which call the table
    epoch changed (the same on every rank, or the ranks did not switch together) and the table."""
    from nodecomm.thresholds import Path

    device = rank_device(rank, device)
    with nodecomm.connect("live", rank, world_size, device=device, socket=socket, timeout=30) as comm:
        first_epoch = comm.thresholds().epoch
        for path, nbytes, seconds in synthetic:
            comm._session.report(Path(path).to_proto(), nbytes, seconds)  # what sampled operations send
        comm._session.flush()
        switched_at = None
        x = torch.ones(4096, device=device)  # 16 KiB
        for call in range(calls):
            comm.all_reduce(x)
            if switched_at is None and comm.thresholds().epoch != first_epoch:
                switched_at = call
            time.sleep(0.002)  # not a wait: the calls are paced to span the daemon's answer to the timings
        rows = [(lo, hi, p.value) for lo, hi, p in comm.thresholds().rows()]
        boundaries = [b.describe() for b in comm.thresholds().boundaries]
        return {"switched_at": switched_at, "rows": rows, "boundary": boundaries[0], "boundaries": boundaries}


def reduce_many(rank: int, world_size: int, socket: str, count: int, calls: int, table_switching: bool = True) -> bool:
    """`calls` default-dispatched all-reduces of `count` float32; True when every result is exact."""
    with nodecomm.connect("many", rank, world_size, socket=socket, timeout=30, table_switching=table_switching) as comm:
        exact = True
        for seed in range(calls):
            x = rank_input(rank, count, torch.float32, seed)
            exact &= torch.equal(comm.all_reduce(x), reference_sum(world_size, count, torch.float32, seed))
        return exact


def sample_backlog(rank: int, world_size: int, socket: str, calls: int) -> dict:
    """`calls` native all-reduces with nothing between them that reaches Python (every call timed:
    the daemon's timing_sample_period is 1, table switches off), then the session's next flush of
    the backlog (once a second) and a second for what it brings, then one more call: what it gave
    and the session's state."""
    with nodecomm.connect("backlog", rank, world_size, socket=socket, timeout=30) as comm:
        x = torch.ones(256)
        for _ in range(calls):
            comm.all_reduce(x, out=x)
        wait_until(
            lambda: comm._dispatch.held() == 0, 30, lambda: f"the session's flush ({comm._dispatch.held()} held)"
        )
        time.sleep(1.0)  # not a wait: the session must outlive the flush (a flush of all once ended it soon after)
        lost = comm._session.lost_reason
        try:
            last = comm.all_reduce(torch.ones(256)).tolist()[:2]
        except nodecomm.NodecommError as error:
            last = f"{type(error).__name__}: {error}"
        return {"lost": lost, "last": last}


def rank_device(rank: int, device: str) -> str:
    """The rank's device: the CPU, or (device "cuda") its GPU, shared where there is only one."""
    if device == "cpu":
        return "cpu"
    gpu = f"cuda:{rank % torch.cuda.device_count()}"
    torch.cuda.set_device(gpu)
    return gpu


def hold_group_for_metrics(rank: int, world_size: int, socket: str, report, commands) -> dict:
    """Join group "prom", all-reduce through oneshot, twoshot and the service path, report
    ("running", rank), then keep the group active until the test sends "stop"; returns each
    path's distinct result values."""
    seen = {}
    with nodecomm.connect("prom", rank, world_size, socket=socket, timeout=60) as comm:
        x = torch.full((4096,), rank + 1.0)
        for _ in range(3):
            for path in ("oneshot", "twoshot", "service"):
                seen[path] = comm.all_reduce(x, path=path).unique().tolist()
        report.put(("running", rank))
        assert commands.get(timeout=240) == "stop"
        comm.barrier()
    return seen


def hold_named_group(rank: int, world_size: int, socket: str, name: str, report, commands) -> None:
    """Join group `name`, report ("joined", rank), and keep it until the test sends "stop"."""
    with nodecomm.connect(name, rank, world_size, socket=socket, timeout=60):
        report.put(("joined", rank))
        assert commands[rank].get(timeout=120) == "stop"


def report_captured_sizes(rank: int, world_size: int, socket: str, report, commands) -> None:
    """Record in the rank's native dispatch what a CUDA group's captured calls record (a CPU
    group captures nothing): 4 KiB captured on the table's oneshot, and 64 KiB, which the table
    gives twoshot, on the oneshot a capture probe chose; flush them to the daemon through the
    session, report "sent" and hold the group until the test sends "stop"."""
    with nodecomm.connect("captured", rank, world_size, socket=socket, timeout=60) as comm:
        native = comm._dispatch
        native.decide(4096, 0, -1, True)
        native.arm_probes(True)
        native.set_probed(65536, 1)  # oneshot's code
        native.decide(65536, 0, -1, True)
        native.arm_probes(False)
        comm._session.flush()
        report.put("sent")
        assert commands[rank].get(timeout=120) == "stop"


def lose_the_daemon(rank: int, world_size: int, socket: str, report, commands) -> list[float] | str:
    """Connect, tell the test, wait until it has killed the daemon, then call again: its result."""
    with nodecomm.connect("lost", rank, world_size, socket=socket, timeout=30) as comm:
        report.put("connected")
        commands.get(timeout=60)
        wait_until(lambda: comm._session.lost_reason is not None, 30, "the session noticing its daemon gone")
        try:
            return comm.all_reduce(torch.ones(4)).tolist()
        except nodecomm.NodecommError as error:
            return f"{type(error).__name__}: {error}"


def disagree(rank: int, world_size: int, socket: str) -> dict:
    """Calls on which rank 1 disagrees with the others: each must raise GroupMismatchError on every
    rank, leave the output as it was, and leave the group working."""
    outcome = {}
    with nodecomm.connect("disagree", rank, world_size, socket=socket, timeout=30) as comm:
        odd = rank == 1
        cases = {
            "count": lambda out: comm.all_reduce(torch.ones(8192 if odd else 4096), out=out[: 8192 if odd else 4096]),
            "count_large": lambda out: comm.all_reduce(torch.ones((1 << 20) if odd else 1024), out=None),
            "count_zero": lambda out: comm.all_reduce(torch.ones(0 if odd else 16), out=out[: 0 if odd else 16]),
            "dtype": lambda out: comm.all_reduce(torch.ones(64, dtype=torch.float16 if odd else torch.float32)),
            "path": lambda out: comm.all_reduce(torch.ones(4096), out=out[:4096], path="twoshot" if odd else "oneshot"),
            "collective": lambda out: (
                comm.all_gather(torch.ones(16)) if odd else comm.all_reduce(torch.ones(16), out=out[:16])
            ),
            "barrier": lambda out: comm.barrier() if odd else comm.all_reduce(torch.ones(16), out=out[:16]),
            "gather_bytes": lambda out: comm.all_gather(torch.ones(5 if odd else 4)),
            "norm_shape": lambda out: comm.all_reduce_rms_norm(
                torch.ones(4096).view(2048, 2) if odd else torch.ones(4096).view(2, 2048),
                torch.ones(2048, 2) if odd else torch.ones(2, 2048),
                torch.ones(2 if odd else 2048),
                1e-6,
                out=out[:4096].view(2048, 2) if odd else out[:4096].view(2, 2048),
                residual_out=out[4096:].view(2048, 2) if odd else out[4096:].view(2, 2048),
            ),
        }
        for name, call in cases.items():
            out = torch.full((8192,), -7.0)
            try:
                call(out)
                outcome[name] = ("no error", "")
            except nodecomm.NodecommError as error:
                outcome[name] = (type(error).__name__, str(error))
            outcome[name] += (bool((out == -7.0).all()),)
            total = comm.all_reduce(torch.full((300,), float(rank + 1)))  # the group still works
            outcome[name] += (total.tolist() == [float(world_size * (world_size + 1) // 2)] * 300,)
        exchange = comm.topk_exchange(max_rows=16, topk=4)
        rows = 12 if odd else 8
        try:
            exchange.stage(torch.zeros(rows, 4, dtype=torch.int32), torch.zeros(rows, 4))
            outcome["topk_rows"] = ("no error", "")
        except nodecomm.NodecommError as error:
            outcome["topk_rows"] = (type(error).__name__, str(error))
        idx, _ = exchange.stage(torch.full((8, 4), rank, dtype=torch.int32), torch.zeros(8, 4))
        outcome["topk_rows"] += (True, idx[:, :, 0].tolist()[0] == list(range(world_size)))
    return outcome


def legitimate_traffic(
    rank: int, world_size: int, socket: str, group: str, calls: int = 100, group_key: str | None = None,
    late_rank_waits: float = 0.0,
) -> tuple[float, float]:  # fmt: skip
    """What an ordinary group does while an attack runs: connect (the last rank `late_rank_waits`
    seconds late, leaving the group forming), then `calls` 1 KiB all-reduces, each checked.
    Returns (seconds to connect, p50 seconds per all-reduce)."""
    if rank == world_size - 1:
        time.sleep(late_rank_waits)  # not a wait: the late rank, late on purpose, leaving the group forming
    started = time.perf_counter()
    with nodecomm.connect(group, rank, world_size, socket=socket, timeout=60, group_key=group_key) as comm:
        connected = time.perf_counter() - started
        x = torch.full((256,), float(rank + 1))
        expected = [float(world_size * (world_size + 1) // 2)] * 256
        times = []
        for _ in range(calls):
            begin = time.perf_counter()
            out = comm.all_reduce(x)
            times.append(time.perf_counter() - begin)
            assert out.tolist() == expected
    return connected, sorted(times)[len(times) // 2]


def wait_for_the_abort(rank: int, world_size: int, socket: str, report) -> tuple[int, int] | None:
    """Rank 0 sleeps on its group's abort word (the futex a CUDA rank's abort watch sleeps on) and
    returns (reason, detail) once woken; the others wait to be killed, or the daemon is."""
    from nodecomm import _native

    with nodecomm.connect("watched", rank, world_size, socket=socket, timeout=30) as comm:
        comm.all_reduce(torch.ones(8))
        # Where rank 0 will sleep: the abort word's upper half, its reason (native/control.h).
        report.put((rank, comm._control.address + 4))
        if rank != 0:
            time.sleep(120)  # killed here by the test
            return None
        reason = _native.wait_for_abort(comm._control.address, 30.0)  # 0 if nothing woke it by then
        return int(reason), int(_native.abort_state(comm._control.address)[1])


def converge(rank: int, world_size: int, socket: str, nbytes: int, calls: int) -> dict:
    """`calls` default-dispatched all-reduces of `nbytes`: where the table in force changed (call,
    epoch, its path for nbytes), and the last table's origin."""
    with nodecomm.connect("converge", rank, world_size, socket=socket, timeout=30) as comm:
        x = torch.ones(nbytes // 4)
        out = torch.empty_like(x)
        epoch, switches = comm.thresholds().epoch, []
        for call in range(calls):
            comm.all_reduce(x, out=out)
            if comm.thresholds().epoch != epoch:
                epoch = comm.thresholds().epoch
                switches.append((call, epoch, comm.thresholds().path_for(nbytes).value))
        return {"switches": switches, "origin": comm.thresholds().origin}


def hold_captured_group(
    rank: int, world_size: int, socket: str, stderr_path: str, job_policy: str, after: str, report
) -> tuple[str, str]:
    """A CPU group standing in for one whose calls CUDA graphs hold: every rank counts a captured
    call as the CUDA lane does under capture (CPU groups have no graphs; the watch and the process
    ending are the same code). This process's stderr goes to `stderr_path`. Rank 0 then, for up
    to 60 s, `after`: "check"s (comm.check(), every 10 ms, as an engine under the "log" policy
    does between steps) or "reduce"s (all-reduces, as replays' kernels wait on a stopped peer);
    the others wait to be killed or stopped (all-reducing in step with rank 0 under "reduce") or
    ("leave") close. Each rank puts its number on `report` once running (under "reduce", once an
    all-reduce in step is done). Returns rank 0's (error, message)."""
    from nodecomm import _native

    with open(stderr_path, "wb") as stderr:
        os.dup2(stderr.fileno(), 2)
    if job_policy:
        os.environ["NODECOMM_CAPTURED_ABORT"] = job_policy
    with nodecomm.connect("captured", rank, world_size, socket=socket, timeout=30) as comm:
        x = torch.ones(1024)
        comm.all_reduce(x)
        _native.record_captured(comm._control.address, rank)
        if after == "reduce":
            comm.all_reduce(x)  # in step with the others: the test stops or kills one from here on
        report.put(rank)
        if rank != 0:
            if after == "reduce":
                with contextlib.suppress(nodecomm.NodecommError):
                    while True:  # until stopped or killed, or rank 0's end aborts the group
                        comm.all_reduce(x)
            if after != "leave":
                time.sleep(120)  # killed or stopped here by the test
            return "left", ""
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                if after == "reduce":
                    comm.all_reduce(x)
                else:
                    comm.check()
                    time.sleep(0.01)
        except nodecomm.NodecommError as raised:
            # Learned before the watch acted: under "exit" it ends this process meanwhile (a rank
            # returning first would race it); a call that raised is followed by check()'s word.
            error = raised
            # Not a wait on an event: the watch's time to end this process, which under "log" (or
            # after an orderly Leave) it never does, so nothing here could say it is over.
            time.sleep(3)
            try:
                comm.check()
            except nodecomm.NodecommError as again:
                error = again
            return type(error).__name__, str(error)
        return "no error", ""


class _Tagged(torch.Tensor):
    """A tensor subclass: left to the Python path."""


def slot_calls(rank: int, world_size: int, socket: str, native: bool) -> dict:
    """What an engine slot gets from slot_all_reduce and accepts(max_bytes=) (or, `native`, from
    the two calls of comm.engine_slot(max_bytes=), as NodecommAllreduce binds them), on a table
    that sends 4 KiB and up to the service path: each call's result (as a list, or None where
    declined)."""
    with nodecomm.connect(
        "slot", rank, world_size, socket=socket, timeout=30, thresholds={"service_min_bytes": "4KiB"}
    ) as comm:
        if native:
            slots = {limit: comm.engine_slot(max_bytes=limit) for limit in (None, 1024, 8192)}

            def call(x, max_bytes=None):
                return slots[max_bytes].custom_all_reduce(x)

            def accepts(x, max_bytes=None):
                return slots[max_bytes].should_custom_ar(x)
        else:
            call, accepts = comm.slot_all_reduce, comm.accepts
        small, large = torch.full((16,), float(rank + 1)), torch.full((2048,), float(rank + 1))
        seen = {
            "small": call(small),
            "large (service path)": call(large),
            "past max_bytes": call(large, max_bytes=1024),
            "float64": call(small.double()),
            "strided": call(torch.ones(32)[::2]),
            "subclass": call(small.as_subclass(_Tagged)),
        }
        answers = {
            "small": accepts(small),
            "past max_bytes": accepts(large, max_bytes=1024),
            "at max_bytes": accepts(large, max_bytes=8192),
            "float64": accepts(small.double()),
            "subclass past max_bytes": accepts(large.as_subclass(_Tagged), max_bytes=1024),
        }
        results = {name: None if out is None else sorted(set(out.tolist())) for name, out in seen.items()}
    answers["closed"] = accepts(small)
    results["closed"] = call(small)
    return {"results": results, "accepts": answers}
