"""Rank programs for the hot path's promises on CUDA (tests/gpu/test_hot_path_cuda.py): no call
synchronises with the GPU, table switch points included, and asynchronous Works leave nothing
behind once waited and dropped."""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import nodecomm
import nodecomm.distributed


def no_sync_no_growth(rank: int, world_size: int, socket: str, port: int, calls: int, async_calls: int) -> dict:
    """Through each API (comm.all_reduce, the slot's call, dist.all_reduce with and without
    async_op, funcol.all_reduce) at 1 KiB: `calls` calls under torch.cuda.set_sync_debug_mode
    ("error"), which catches torch's own synchronisations; and 64 calls (4 table switch points)
    enqueued behind a kernel that sleeps about a second, which the host must outrun: nodecomm's own
    native calls are seen by that alone. Then `async_calls` asynchronous dist.all_reduces of fresh
    64 KiB tensors, each waited and dropped: the allocated GPU memory and the backend's outstanding
    Works before and after."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODECOMM_SOCKET=socket)  # fmt: skip
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("nodecomm")
    comm = nodecomm.connect("hot", rank, world_size, device=device, socket=socket, timeout=60)
    x, y = torch.ones(256, device=device), torch.empty(256, device=device)
    calls_of = {
        "comm.all_reduce": lambda: comm.all_reduce(x, out=y),
        "comm.slot_all_reduce": lambda: comm.slot_all_reduce(x),
        "dist.all_reduce": lambda: dist.all_reduce(y),
        "dist.all_reduce(async_op=True).wait()": lambda: dist.all_reduce(y, async_op=True).wait(),
        "funcol.all_reduce": lambda: funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD)),
    }
    for call in calls_of.values():  # joins, first launches: what may synchronise once
        call()
    torch.cuda.synchronize()
    synchronised, waited = {}, []
    for name, call in calls_of.items():
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(calls):
                call()
        except RuntimeError as error:
            synchronised[name] = str(error).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU cycles ahead of the calls
        for _ in range(64):
            call()
        if torch.cuda.current_stream(device).query():
            waited.append(name)  # the host waited for the stream somewhere in those calls
        torch.cuda.synchronize()

    backend = dist.group.WORLD._get_backend(device)
    gc.collect()
    before = (torch.cuda.memory_allocated(device), backend.outstanding)
    for _ in range(async_calls):
        t = torch.ones(16384, device=device)
        dist.all_reduce(t, async_op=True).wait()
        del t
    torch.cuda.synchronize()
    gc.collect()
    after = (torch.cuda.memory_allocated(device), backend.outstanding)
    comm.close()
    dist.destroy_process_group()
    return {"synchronised": synchronised, "waited": waited, "before": before, "after": after}
