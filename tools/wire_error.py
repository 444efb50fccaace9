"""nodecomm bench --op wire-error: what the compressed wires cost in accuracy, measured through a
real group (a private daemon unless --socket), against the exact sum of the same inputs.

Inputs: Gaussian values with rare large outliers (one in 1024 elements 20-100x, as hidden states
and their partial sums have), and real tensor-parallel partial sums: all-MiniLM-L6-v2's last MLP
down-projection over a few sentences, split over 8 shards (docs/data/minilm_partials.pt; for a
smaller world each rank sums 8/world of them). Per input, dtype and world size: each wire's
largest absolute error and its RMS error relative to the sum's RMS, whether every element stayed
within error_bound, and the same figures for the lossless wire and for accumulating in the dtype
itself, as NCCL's ring does (rank order, rounded after every addition), for scale.
"""

from __future__ import annotations

import os
from pathlib import Path

from nodecomm.wire_bounds import error_bound, exact_sum

from .bench import run_ranks, start_rank

PARTIALS = Path(__file__).resolve().parents[1] / "docs" / "data" / "minilm_partials.pt"
KINDS = ("gaussian+outliers", "minilm-partials")
WIRES = ("int8", "fp8")
DTYPE_NAMES = ("float32", "float16", "bfloat16")


def gaussian_input(rank: int, count: int, seed: int):
    """fp32 Gaussian values with one in 1024 replaced by a 20-100x outlier."""
    import torch

    generator = torch.Generator().manual_seed(seed * 131 + rank)
    x = torch.randn(count, generator=generator)
    outliers = torch.rand(count, generator=generator) < 1 / 1024
    return torch.where(outliers, x.sign() * (20 + 80 * torch.rand(count, generator=generator)), x)


def minilm_input(rank: int, world_size: int, partials_path: Path = PARTIALS):
    """Rank `rank`'s partial sum of world `world_size` (a divisor of 8), in fp32."""
    import torch

    partials = torch.load(partials_path).float()
    per = partials.shape[0] // world_size
    return partials[rank * per : (rank + 1) * per].sum(dim=0).flatten()


def inputs_of(kind: str, world_size: int, dtype, count: int):
    if kind == "gaussian+outliers":
        return [gaussian_input(r, count, 7).to(dtype) for r in range(world_size)]
    return [minilm_input(r, world_size).to(dtype) for r in range(world_size)]


def errors(result, exact) -> tuple[float, float]:
    """(largest absolute error, RMS error / RMS of the exact sum) against `exact` (exact_sum)."""
    error = result.double().flatten() - exact
    return float(error.abs().max()), float(error.pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())


def dtype_accumulation(inputs: list):
    """NCCL's ring, as far as rounding goes: rank order, rounded to the dtype after every addition."""
    acc = inputs[0].clone()
    for x in inputs[1:]:
        acc = (acc.float() + x.float()).to(x.dtype)
    return acc


def _rank_main(rank: int, world_size: int, args: dict, port: int, report) -> object:
    device = start_rank(rank, world_size, args, port)
    import torch
    import torch.distributed as dist

    import nodecomm

    rows = []
    on_gpu = {"device": device} if device != "cpu" else {}
    with nodecomm.connect("wire-error", rank, world_size, socket=args["socket"], timeout=120, **on_gpu) as comm:
        for kind in KINDS:
            for dtype_name in DTYPE_NAMES:
                dtype = getattr(torch, dtype_name)
                inputs = inputs_of(kind, world_size, dtype, args["count"])
                mine = inputs[rank].to(device)
                outcomes = {wire: comm.all_reduce(mine, wire=wire).cpu() for wire in (*WIRES, "lossless")}
                if rank != 0:
                    continue
                exact = exact_sum(inputs)
                for wire, result in outcomes.items():
                    within = ""
                    if wire != "lossless":
                        within = str(
                            bool(((result.double().flatten() - exact).abs() <= error_bound(inputs, wire)).all())
                        )
                    rows.append((kind, dtype_name, world_size, wire, *errors(result, exact), within))
                accumulated = errors(dtype_accumulation(inputs), exact)
                rows.append((kind, dtype_name, world_size, f"{dtype_name} accumulation", *accumulated, ""))
    dist.destroy_process_group()
    return rows if rank == 0 else None


def run_wire_error(world_sizes: list[int], count: int, socket: str | None, device: str = "cpu") -> str:
    """The table, one run per world size (each a divisor of 8), on CPU or CUDA groups (ranks
    spread over the visible GPUs, sharing them where there are fewer)."""
    import platform

    import torch

    gpus = torch.cuda.device_count() if device == "cuda" else 0

    lines = [
        f"# nodecomm bench --op wire-error: {count} elements per rank (Gaussian), minilm partials "
        f"{PARTIALS.name}; {device} groups; host={platform.node()} cpus={os.cpu_count()}",
        "# error against the exact (float64) sum of the same inputs; rms rel: RMS error / RMS of the sum",
        "",
        "| input | dtype | world | wire | max abs error | RMS relative error | within the bound |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for world_size in world_sizes:
        # A private daemon lets CUDA ranks share a GPU where there are fewer than ranks.
        shared_devices = ("--allow-shared-devices", "true") if device == "cuda" and world_size > gpus else ()
        for kind, dtype, world, wire, worst, rms, within in run_ranks(
            _rank_main, world_size, {"count": count, "device": device}, socket, shared_devices
        ):
            lines.append(f"| {kind} | {dtype} | {world} | {wire} | {worst:.3g} | {rms:.3g} | {within} |")
    return "\n".join(lines)
