"""Rank programs of the fault suite (importable by spawned children). Each works at one stage of a
group's life until something fails, and returns what it saw: (error class, message, seconds from
the test's signal to the error). The test process stops or kills one of them meanwhile."""

from __future__ import annotations

import os
import time

import torch

import nodecomm
from ranks import rank_device

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

STAGES = ("joining", "idle", "collective", "topk", "service")


def _failure(error: Exception, signalled, at: float | None = None) -> tuple[str, str, float]:
    return type(error).__name__, str(error), time.time() - (signalled.get(timeout=60) if at is None else at)


def work_until_error(
    rank: int, world_size: int, socket: str, group: str, stage: str, report, signalled, device: str = "cpu"
):
    """Keep working at `stage` until an error, reporting ("ready", rank) once the work is under way
    (a step of it done; at "joining" and "idle", once there); the test puts the signal's time on
    `signalled` (once per surviving rank). device "cuda": on the rank's GPU, synchronising after
    each step so that a kernel that gave up is seen."""
    device = rank_device(rank, device)
    if stage == "joining":
        report.put(("ready", rank))
        if rank == 1:
            time.sleep(600)  # the victim never joins: the test stops or kills it here
        try:
            nodecomm.connect(group, rank, world_size, device=device, socket=socket, timeout=5).close()
        except nodecomm.NodecommError as error:
            return _failure(error, signalled)
        return "no error", "", 0.0
    comm = nodecomm.connect(group, rank, world_size, device=device, socket=socket, timeout=30)
    exchange = comm.topk_exchange(64, 8) if stage == "topk" else None
    x = torch.ones(4096, device=device)
    comm.all_reduce(x)
    at = None
    ready = False
    try:
        if stage == "idle":
            report.put(("ready", rank))
            if rank == 1:
                time.sleep(600)  # mapped and idle: the test stops or kills the victim here
            at = signalled.get(timeout=60)  # the survivor idles until the victim has been signalled
            ready = True
        while True:
            if stage in ("idle", "collective"):
                comm.all_reduce(x)
            elif stage == "topk":
                exchange.stage(torch.zeros(64, 8, dtype=torch.int32, device=device), torch.zeros(64, 8, device=device))
            else:
                works = [comm.all_reduce(x, path="service", async_op=True) for _ in range(3)]
                for work in works:
                    work.wait()
            if device != "cpu":
                torch.cuda.synchronize()
            if not ready:  # a step of the stage's work done: the test may signal
                report.put(("ready", rank))
                ready = True
    except nodecomm.NodecommError as error:
        return _failure(error, signalled, at)
    finally:
        comm.close()


def reform(rank: int, world_size: int, socket: str, group: str, device: str = "cpu") -> float:
    """Form `group` again and all-reduce once: the sum."""
    device = rank_device(rank, device)
    with nodecomm.connect(group, rank, world_size, device=device, socket=socket, timeout=30) as comm:
        return comm.all_reduce(torch.full((16,), float(rank + 1), device=device))[0].item()
