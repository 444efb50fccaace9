"""Rank programs that keep calling while the test stops, kills and restarts their daemon
(tests/test_daemon_restart.py): every result checked exactly, every failure counted."""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import time

import torch
import torch.distributed as dist

import nodecomm
import nodecomm.distributed  # registers the "nodecomm" backend
from waiting import wait_until

ROWS, TOPK = 8, 4
GAP_CALLS = 50  # adopted(): all-reduces while no daemon serves


def ride_through(rank: int, world_size: int, socket: str, port: int, api: str, report, commands) -> dict:
    """Call in a loop until the test says "stop": through `api` "connect" an all-reduce, an
    all-gather and a top-k stage per step, through "dist" (init_process_group("nodecomm")) a
    dist.all_reduce and a dist.all_gather_single, each step's inputs new and its outputs
    checked bit for bit. Then leave, and form a new group on the daemon serving now. Returns the
    steps, the failed and the wrong ones (the first few errors), the longest pause between two
    steps' ends (ms), the new group's sum, whether leaving raised and (through connect) whether
    the session saw its daemon go. `commands`: every rank's queue."""
    full = world_size * (world_size - 1) // 2
    if api == "connect":
        comm = nodecomm.connect("ride", rank, world_size, socket=socket, timeout=60, operation_timeout=20)
        exchange = comm.topk_exchange(ROWS, TOPK)

        def one_step(k: int, leaving: bool) -> tuple[bool, bool]:
            summed = comm.all_reduce(_values(k + rank, leaving))
            gathered = comm.all_gather(torch.tensor([10 * k + rank], dtype=torch.int64))
            owned_idx, _ = exchange.stage(
                torch.full((ROWS, TOPK), 10 * k + rank, dtype=torch.int32), torch.zeros((ROWS, TOPK))
            )
            sources = torch.arange(world_size, dtype=torch.int32).view(1, -1, 1)
            return (
                bool((summed[:-1] == world_size * k + full).all())
                and gathered.flatten().tolist() == [10 * k + r for r in range(world_size)]
                and bool((owned_idx == 10 * k + sources).all())
            ), bool(summed[-1] > 0)
    else:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), NODECOMM_SOCKET=socket)  # fmt: skip
        dist.init_process_group("nodecomm")

        def one_step(k: int, leaving: bool) -> tuple[bool, bool]:
            x = _values(k + rank, leaving)
            dist.all_reduce(x)
            gathered = torch.empty(world_size, dtype=torch.int64)
            dist.all_gather_single(gathered, torch.tensor([10 * k + rank], dtype=torch.int64))
            exact = bool((x[:-1] == world_size * k + full).all())
            return exact and gathered.tolist() == [10 * k + r for r in range(world_size)], bool(x[-1] > 0)

    one_step(0, False)
    report.put(("running", rank))
    outcome = _steps(one_step, commands[rank])
    # Whether this rank's session is still without a daemon, and how often its group was handed
    # to a new one (dist's communicators hold theirs inside).
    lost = comm._session.lost_reason is not None if api == "connect" else None
    adoptions = comm._session.adoptions if api == "connect" else None
    left = "ok"
    try:
        if api == "connect":
            comm.close()
        else:
            dist.destroy_process_group()
    except Exception as error:  # what leaving a group whose daemon is gone raised
        left = f"{type(error).__name__}: {error}"
    with nodecomm.connect("after", rank, world_size, socket=socket, timeout=60) as again:
        after = again.all_reduce(torch.full((4,), float(rank + 1))).tolist()
    return {**outcome, "after": after, "left": left, "lost": lost, "adoptions": adoptions}


def _steps(one_step, commands) -> dict:
    """`one_step(k, leaving) -> (exact, stop)` for k = 1, 2, ... until every rank stops after the
    same step, the one whose sum says a rank asked to (once `commands` said "stop"); three failed
    steps end it too. The steps, the failed and the wrong ones (the first few errors) and the
    longest pause between two steps' ends (ms)."""
    step, failed, wrong, errors, longest, last = 0, 0, 0, [], 0.0, time.monotonic()
    leaving = stop = False
    while not stop:
        step += 1
        try:
            exact, stop = one_step(step, leaving)
            wrong += not exact
        except nodecomm.NodecommError as error:
            failed += 1
            errors.append(f"{type(error).__name__}: {error}")
            if failed >= 3:
                break
        now = time.monotonic()
        longest, last = max(longest, now - last), now
        try:
            leaving = leaving or commands.get_nowait() == "stop"
        except queue.Empty:
            pass
    return {"steps": step, "failed": failed, "wrong": wrong, "errors": errors[:3], "longest_ms": longest * 1e3}


def _values(value: int, leaving: bool) -> torch.Tensor:
    """A step's all-reduce input: 4096 of `value`, then 1 where this rank asks every rank to stop."""
    x = torch.full((4097,), float(value))
    x[-1] = float(leaving)
    return x


def die_while_no_daemon(rank: int, world_size: int, socket: str, report, commands) -> tuple[str, str, float] | None:
    """All-reduce until told the daemon is gone; then rank 1 dies (the test kills it) and rank 0
    calls on: the error its next call raises and how long after the death it came. `commands`:
    every rank's queue."""
    commands = commands[rank]
    with nodecomm.connect("orphan", rank, world_size, socket=socket, timeout=60, operation_timeout=2) as comm:
        comm.all_reduce(torch.ones(8))
        report.put(("running", rank))
        assert commands.get(timeout=60) == "daemon gone"
        comm.all_reduce(torch.ones(8))  # still served, by the peers alone
        report.put(("served", rank))
        if rank != 0:
            time.sleep(120)  # killed
            return None
        assert commands.get(timeout=60) == "peer killed"
        killed = time.monotonic()
        try:
            while True:
                comm.all_reduce(torch.ones(8))
        except nodecomm.NodecommError as error:
            return type(error).__name__, str(error), time.monotonic() - killed


def lose_the_daemon_with(rank: int, world_size: int, socket: str, thresholds: dict, report, commands) -> list | str:
    """Join with `thresholds` (a service range: a group that needs its daemon), wait until the test
    has killed the daemon, then all-reduce a small tensor: its result or error. `commands`: every
    rank's queue."""
    with nodecomm.connect("needs", rank, world_size, socket=socket, timeout=60, thresholds=thresholds) as comm:
        comm.all_reduce(torch.ones(4))
        report.put(("running", rank))
        assert commands[rank].get(timeout=60) == "daemon gone"
        wait_until(lambda: comm._session.lost_reason is not None, 30, "the session noticing its daemon gone")
        try:
            return comm.all_reduce(torch.ones(4)).tolist()
        except nodecomm.NodecommError as error:
            return f"{type(error).__name__}: {error}"


def adopted(rank: int, world_size: int, socket: str, report, commands) -> dict:
    """Once the test has killed the daemon: GAP_CALLS all-reduces, reported ("called", rank); once
    it has started another on the socket: all-reduce until the
    group was handed to it, then open a top-k exchange there and stage once, all-reduce, and report
    ("adopted", rank, its ticket). Then, as the test says, "leave" (close: Leave through the new
    daemon) or "die" (rank 1 is killed; rank 0 calls until it raises). `commands`: every rank's queue."""
    with nodecomm.connect("adopted", rank, world_size, socket=socket, timeout=60, operation_timeout=5) as comm:
        report.put(("running", rank))
        assert commands[rank].get(timeout=60) == "daemon gone"
        for _ in range(GAP_CALLS):
            assert comm.all_reduce(torch.ones(4)).tolist() == [float(world_size)] * 4
        report.put(("called", rank))
        assert commands[rank].get(timeout=60) == "next daemon serving"
        calls, deadline = 0, time.monotonic() + 30
        while time.monotonic() < deadline:  # until every rank's group was handed over (the sum says)
            calls += 1
            if comm.all_reduce(torch.tensor([float(comm._session.adoptions > 0)])).item() == world_size:
                break
        exchange = comm.topk_exchange(ROWS, TOPK)
        owned_idx, _ = exchange.stage(torch.full((ROWS, TOPK), rank, dtype=torch.int32), torch.zeros((ROWS, TOPK)))
        staged = bool((owned_idx == torch.arange(world_size, dtype=torch.int32).view(1, -1, 1)).all())
        summed = comm.all_reduce(torch.ones(4)).tolist()
        report.put(("adopted", rank, comm._link.ticket.SerializeToString()))
        outcome = {"adoptions": comm._session.adoptions, "calls": calls, "staged": staged, "sum": summed}
        command = commands[rank].get(timeout=120)
        if command == "leave":
            comm.close()
            # Every stream's request thread ends with it: the lost one's too.
            with contextlib.suppress(AssertionError):
                wait_until(lambda: _request_threads() == 0, 10, "the request threads ending")
            return {**outcome, "request_threads": _request_threads()}
        if rank != 0:
            report.put(("dying", rank))
            time.sleep(120)  # killed here by the test
        _, killed = command  # ("die", when the test killed rank 1: CLOCK_MONOTONIC is the machine's)
        try:
            while True:
                comm.all_reduce(torch.ones(8))
        except nodecomm.NodecommError as error:
            return {**outcome, "error": f"{type(error).__name__}: {error}", "took": time.monotonic() - killed}


def _request_threads() -> int:
    """Threads still reading a Session's requests (client/session.py's _requests), for gRPC."""

    def reading(frame) -> bool:
        while frame is not None:
            if frame.f_code.co_name == "_requests" and frame.f_code.co_filename.endswith("session.py"):
                return True
            frame = frame.f_back
        return False

    return sum(reading(frame) for frame in sys._current_frames().values())


def waiting_in_a_barrier(rank: int, world_size: int, socket: str, report, commands) -> dict:
    """Rank 0 stays away (the test says for how long) while the other ranks wait in a barrier,
    through which the test restarts the daemon; then every rank meets there and all-reduces."""
    with nodecomm.connect("barrier", rank, world_size, socket=socket, timeout=60, operation_timeout=30) as comm:
        comm.all_reduce(torch.ones(4))
        report.put(("running", rank))
        if rank == 0:
            away = commands[rank].get(timeout=60)
            time.sleep(away)  # not a wait: rank 0's long host step (loading, compiling)
        else:
            assert commands[rank].get(timeout=60) == "wait"
            report.put(("in the barrier", rank))
        comm.barrier()
        return {"sum": comm.all_reduce(torch.ones(4)).tolist(), "adoptions": comm._session.adoptions}


def ride_through_on_cuda(rank: int, world_size: int, socket: str, report, commands) -> dict:
    """On the GPU (ranks sharing it): a CUDA graph of one all-reduce captured before any restart,
    then, until the test says "stop", steps of an eager all-reduce of new inputs and a replay of
    the graph on new inputs, every output compared bit for bit, while the test restarts the
    daemon. Returns the steps, the failed and wrong ones, the longest pause (ms) and how often the
    group was handed to a new daemon. `commands`: every rank's queue."""
    device = f"cuda:{rank % torch.cuda.device_count()}"
    torch.cuda.set_device(device)
    full = world_size * (world_size - 1) // 2
    with nodecomm.connect("ride-cuda", rank, world_size, device=device, socket=socket, timeout=60) as comm:
        static_in = torch.zeros(4097, device=device)
        static_out = torch.empty_like(static_in)
        comm.all_reduce(static_in, out=static_out)  # warm-up before capture
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(graph, stream=stream):
            comm.all_reduce(static_in, out=static_out)

        def one_step(k: int, leaving: bool) -> tuple[bool, bool]:
            summed = comm.all_reduce(_values(k + rank, leaving).to(device))
            static_in.copy_(_values(2 * k + rank, False).to(device))
            graph.replay()
            exact = bool((summed[:-1] == world_size * k + full).all()) and bool(
                (static_out[:-1] == world_size * 2 * k + full).all()
            )
            return exact, bool(summed[-1] > 0)

        report.put(("running", rank))
        return {**_steps(one_step, commands[rank]), "adoptions": comm._session.adoptions}


def ride_on_private(rank: int, world_size: int, runtime: str, report, commands) -> dict:
    """On the job's own daemon (daemon="private", under `runtime`): report ("running", rank, its
    socket), then all-reduce steps, each checked, until the test says "stop", while the test kills
    that daemon (one of the ranks starts the next). The steps, failures, the longest pause and how
    often the group was handed on. `commands`: every rank's queue."""
    os.environ["XDG_RUNTIME_DIR"] = runtime
    full = world_size * (world_size - 1) // 2
    with nodecomm.connect("job", rank, world_size, daemon="private", timeout=60, operation_timeout=20) as comm:

        def one_step(k: int, leaving: bool) -> tuple[bool, bool]:
            summed = comm.all_reduce(_values(k + rank, leaving))
            return bool((summed[:-1] == world_size * k + full).all()), bool(summed[-1] > 0)

        report.put(("running", rank, comm.daemon.socket))
        return {**_steps(one_step, commands[rank]), "adoptions": comm._session.adoptions}
