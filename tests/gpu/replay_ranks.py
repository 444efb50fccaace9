"""Rank programs that replay captured CUDA graphs while a peer is killed or stopped: what an
engine's decode loop does, with no nodecomm call between replays (tests/gpu/test_captured_abort_cuda.py)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import nodecomm
import nodecomm.distributed

HIDDEN, ROWS, TOPK = 256, 8, 4
TIMEOUT_S = 3  # the group's operation timeout: how long a replay waits for a stopped peer


def replay_until_abort(rank: int, world_size: int, socket: str, port: int, how: str, stderr_path: str, report) -> dict:
    """Capture in one graph what a decode step holds of nodecomm, through `how`: "comm" (an
    all-reduce of 64K floats, the fused all-reduce + RMSNorm and a top-k stage), "distributed"
    (dist.all_reduce of init_process_group("nodecomm")) or "vllm" (the vLLM stand-in's all_reduce
    inside its graph_capture); then both ranks replay it with new inputs, in step, until rank 1 is
    killed or stopped (each puts its number on `report` after its third replay). After each replay
    rank 0 synchronises, reads the outputs, then calls check(), as an engine that checks its steps
    would, for up to 120 s. This process's stderr goes to `stderr_path`, where rank 0 writes a line
    for every stale output that check() let through ("silent"): there must be none. Returns (if
    the process is not ended) rank 0's replays, the stale ones, the silent ones and check()'s
    error."""
    with open(stderr_path, "wb") as stderr:
        os.dup2(stderr.fileno(), 2)
    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    # The engine's objects are held while it replays, as an engine holds them: dropped, they would
    # close and unmap the buffers the graph addresses.
    step, check, _engine_objects = _captured_step(rank, world_size, socket, port, how, device)
    replays = stale = silent = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        replays += 1
        fresh = step(replays)
        torch.cuda.synchronize()
        if replays == 3:
            report.put(rank)
        if rank != 0:
            continue  # replays until killed or stopped
        wrong = fresh()
        stale += bool(wrong)
        try:
            check()
        except nodecomm.NodecommError as error:
            # A kernel that gave up sets the abort word from the GPU, which the watch reads at its
            # next look (20 ms): under "exit" it ends this process meanwhile. Not a wait on an
            # event: under "log" the watch never ends it, so nothing here could say it is over.
            time.sleep(3)
            return {"replays": replays, "stale": stale, "silent": silent, "error": (type(error).__name__, str(error))}
        if wrong:
            silent += 1
            os.write(2, f"silent stale output at replay {replays}: {wrong}\n".encode())
    return {"replays": replays, "stale": stale, "silent": silent, "error": None}


def _captured_step(rank: int, world_size: int, socket: str, port: int, how: str, device: torch.device):
    """(step(k): refill the inputs for replay k, replay, and return fresh(): "" where every output
    is replay k's result, else what differs; check: the engine's comm.check(); what the engine
    holds while it replays: the objects whose buffers the graph addresses, which closing, or
    dropping, would unmap under the replays)."""
    full = world_size * (world_size - 1) // 2  # the sum of the ranks' offsets

    def expected(k: int) -> float:
        return float(world_size * k + full)

    def differs(name: str, got: torch.Tensor, want: torch.Tensor | float) -> str:
        if bool((got == want).all()):
            return ""
        values = got.float().unique()[:4].tolist()
        return (
            f"{name} holds {values} where {want if isinstance(want, float) else want.flatten()[:4].tolist()} is due; "
        )

    # 64K floats; 4K under vLLM, where the sizes the table gives NCCL go to the engine's own
    # all-reduce (gloo where ranks share a GPU, which no graph captures).
    x = torch.empty(1 << 12 if how == "vllm" else 1 << 16, device=device)
    if how == "comm":
        comm = nodecomm.connect("replayed", rank, world_size, device=device, socket=socket, timeout=60)
        y = torch.empty_like(x)
        rows = torch.empty((ROWS, HIDDEN), dtype=torch.bfloat16, device=device)
        residual = torch.zeros_like(rows)
        weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device=device)
        normed, summed = torch.empty_like(rows), torch.empty_like(rows)
        exchange = comm.topk_exchange(ROWS, TOPK)
        idx = torch.empty((ROWS, TOPK), dtype=torch.int32, device=device)
        scores = torch.zeros((ROWS, TOPK), dtype=torch.float32, device=device)

        def capture() -> list[torch.Tensor]:
            comm.all_reduce(x, out=y)
            comm.all_reduce_rms_norm(rows, residual, weight, 1e-6, out=normed, residual_out=summed)
            return list(exchange.stage(idx, scores))

        def refill(k: int) -> None:
            x.fill_(k + rank)
            rows.fill_(k % 64 + rank)  # sums up to 2 * 63 + world_size: exact in bfloat16
            idx.fill_(10 * k + rank)

        def fresh(k: int, outputs: list[torch.Tensor]) -> str:
            owned_idx = outputs[0]  # [owned rows, source, topk]: each source's candidates
            sources = torch.arange(world_size, device=device, dtype=torch.int32).view(1, -1, 1)
            return (
                differs("the all-reduce", y, expected(k))
                + differs("the fused norm's sum", summed.float(), expected(k % 64))
                + differs("the top-k stage", owned_idx, (10 * k + sources).expand_as(owned_idx))
            )

        check = comm.check
    elif how == "distributed":
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODECOMM_SOCKET=socket)  # fmt: skip
        # The group's timeout is the operation timeout its collectives wait (the daemon's is only a default).
        dist.init_process_group("nodecomm", timeout=timedelta(seconds=TIMEOUT_S))

        def capture() -> list[torch.Tensor]:
            dist.all_reduce(x)
            return []

        def refill(k: int) -> None:
            x.fill_(k + rank)

        def fresh(k: int, outputs: list[torch.Tensor]) -> str:
            return differs("the all-reduce", x, expected(k))

        check = nodecomm.distributed.communicator(None, device).check
    else:
        import engine_ranks

        communicator, ca_comm, _ = engine_ranks.engine_communicator(rank, world_size, socket, port, "vllm", "cuda")
        out: list[torch.Tensor] = []

        def capture() -> list[torch.Tensor]:
            out[:] = [communicator.all_reduce(x)]
            return out

        def refill(k: int) -> None:
            x.fill_(k + rank)

        def fresh(k: int, outputs: list[torch.Tensor]) -> str:
            return differs("the all-reduce", outputs[0], expected(k))

        check = ca_comm.comm.check

    refill(0)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    if how == "vllm":
        with communicator.graph_capture(stream):
            capture()  # the warm-up inside capture(), as the engine's
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                outputs = capture()
    else:
        with torch.cuda.stream(stream):
            capture()  # warm-up, eager
        torch.cuda.synchronize()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            outputs = capture()

    def step(k: int):
        refill(k)
        graph.replay()
        return lambda: fresh(k, outputs)

    return step, check, capture  # capture() holds the communicator, exchange or engine communicator
