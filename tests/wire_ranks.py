"""Compressed wires: a reference written with torch alone (independent of native/wire.h) and the
rank programs of tests/test_wires.py (importable by spawned children); the error bound and the
inputs are the error table's (tools/wire_error.py)."""

from __future__ import annotations

import math
import time

import torch

import nodecomm
from nodecomm.tools.wire_error import gaussian_input
from nodecomm.wire_bounds import error_bound, exact_sum
from ranks import BITS, DTYPES

BLOCK = 32
LIMIT = {"int8": 127.0, "fp8": 448.0}
ZERO_BELOW = 2.0**-100


def blocks_of(values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """fp32 values as rows of BLOCK (the last padded with zeros, which change no block's absmax)."""
    flat = values.float().flatten()
    return torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK)).view(-1, BLOCK), flat.numel()


def dequantized(x: torch.Tensor, wire: str) -> torch.Tensor:
    """What a rank's input contributes on `wire`, in fp32: each block scaled by its largest finite
    magnitude, rounded to int8 or E4M3 (nearest even), scaled back; non-finite elements as NaN."""
    blocks, count = blocks_of(x)
    finite = torch.isfinite(blocks)
    absmax = torch.where(finite, blocks.abs(), torch.zeros_like(blocks)).amax(dim=1, keepdim=True)
    zero = absmax < ZERO_BELOW
    limit = LIMIT[wire]
    # Tensor by tensor: torch turns a scalar divided by a tensor (or a tensor by a scalar) into a
    # multiply by a reciprocal, which is not the one fp32 division native/wire.h does.
    limits = torch.full_like(absmax, limit)
    inverse = torch.where(zero, torch.zeros_like(absmax), limits / absmax)
    scale = torch.where(zero, torch.zeros_like(absmax), absmax / limits)
    y = torch.where(finite, blocks * inverse, torch.zeros_like(blocks)).clamp(-limit, limit)
    if wire == "int8":
        codes = torch.round(y).to(torch.int8).float()  # int8 has no -0
    else:
        codes = y.to(torch.float8_e4m3fn).float()
    values = torch.where(finite, codes * scale, torch.full_like(blocks, math.nan))
    return values.flatten()[:count]


def reference(inputs: list[torch.Tensor], wire: str) -> torch.Tensor:
    """Every rank's dequantized input summed in fp32 in rank order, rounded once to their dtype."""
    acc = dequantized(inputs[0], wire)
    for x in inputs[1:]:
        acc = acc + dequantized(x, wire)
    return acc.view(inputs[0].shape).to(inputs[0].dtype)


def rank_order_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The lossless paths' sum: fp32 in rank order, rounded once."""
    acc = inputs[0].float().clone()
    for x in inputs[1:]:
        acc += x.float()
    return acc.to(inputs[0].dtype)


def activations(rank: int, count: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian values with rare large outliers, as the error table's (tools/wire_error.py)."""
    return gaussian_input(rank, count, seed).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaNs (whose payloads the paths spell differently) equal wherever both are NaN."""
    nan = torch.isnan(a.float())
    if not torch.equal(nan, torch.isnan(b.float())):
        return False
    return torch.equal(a.view(BITS[a.dtype])[~nan], b.view(BITS[b.dtype])[~nan])


def _device(rank: int, kind: str | None) -> str | None:
    """None for a CPU group; "cuda": this rank's GPU (ranks share them where there are fewer)."""
    return None if kind is None else f"cuda:{rank % torch.cuda.device_count()}"


def _group(name: str, rank: int, world_size: int, socket: str, device: str | None):
    """A CPU group, or a CUDA group on `device` (made current)."""
    if device is None:
        return nodecomm.connect(name, rank, world_size, socket=socket, timeout=60)
    torch.cuda.set_device(device)
    return nodecomm.connect(name, rank, world_size, socket=socket, timeout=120, device=device)


def compressed_cases(
    rank: int,
    world_size: int,
    socket: str,
    cases: list[tuple[str, int]],
    device: str | None = None,  # None: a CPU group; "cuda": a CUDA group
    paths: tuple[str, ...] = ("oneshot", "twoshot"),
) -> list[str]:
    """Every (dtype, count) case on both wires and every path: the reference's bits (so every
    rank's are the same) within the stated bound; the lossless call beside them unchanged. On a
    CUDA group (`device`) also into an output one element past an aligned start."""
    device = _device(rank, device)
    problems = []
    with _group("wires", rank, world_size, socket, device) as comm:
        for index, (dtype_name, count) in enumerate(cases):
            dtype = DTYPES[dtype_name]
            inputs = [activations(r, count, dtype, index) for r in range(world_size)]
            mine, exact = inputs[rank].to(device or "cpu"), exact_sum(inputs)
            for wire in ("int8", "fp8"):
                expected = reference(inputs, wire)
                bound = error_bound(inputs, wire)
                results = {path: comm.all_reduce(mine, path=path, wire=wire) for path in paths}
                if device is not None:
                    for path in paths:
                        shifted = torch.empty(count + 1, dtype=dtype, device=device)[1:]
                        comm.all_reduce(mine, out=shifted, path=path, wire=wire)
                        results[f"{path} unaligned"] = shifted
                for path, y in results.items():
                    y = y.cpu()
                    if not same_bits(y, expected):
                        wrong = int((y.view(BITS[dtype]) != expected.view(BITS[dtype])).sum())
                        problems.append(f"{wire} {path} {dtype_name} count={count}: {wrong} elements differ")
                    error = (y.double() - exact).abs()
                    if count and not bool((error <= bound).all()):
                        worst = int((error - bound).argmax())
                        problems.append(
                            f"{wire} {path} {dtype_name} count={count}: element {worst} is off by "
                            f"{float(error[worst]):.3g}, past the bound {float(bound[worst]):.3g}"
                        )
            lossless = comm.all_reduce(mine, wire="lossless").cpu()
            if not same_bits(lossless, rank_order_sum(inputs)):
                problems.append(f"lossless {dtype_name} count={count} differs from the rank-order sum")
    return problems


def special_blocks(rank: int, world_size: int, socket: str, device: str | None = None) -> dict:
    """Blocks holding inf or NaN (on rank 0 only), an all-zero block, and E4M3's every code and
    every midpoint between neighbours (blocks anchored by 448, so they are sent unscaled); on a
    CUDA group (`device`) every path."""
    device = _device(rank, device)
    seen = {}
    paths = ("oneshot", "twoshot", "dma") if device else ("oneshot", "twoshot")
    with _group("special", rank, world_size, socket, device) as comm:
        x = torch.ones(4 * BLOCK)
        x[BLOCK : 2 * BLOCK] = 0.0
        if rank == 0:
            x[5], x[2 * BLOCK + 7], x[3 * BLOCK + 1] = math.inf, -math.inf, math.nan
        for wire in ("int8", "fp8"):
            by_path = {}
            for path in paths:
                y = comm.all_reduce(x.to(device or "cpu"), wire=wire, path=path).cpu()
                by_path[path] = {
                    "nan": torch.isnan(y).nonzero().flatten().tolist(),
                    "zero_block": y[BLOCK : 2 * BLOCK].tolist(),
                    "block_rest": y[:5].tolist() + y[6:BLOCK].tolist(),
                }
            # One answer where every path gave it, else each path's (which the test shows).
            same = all(found == by_path[paths[0]] for found in by_path.values())
            seen[wire] = by_path[paths[0]] if same else by_path
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
        values = codes[torch.isfinite(codes)].unique()
        midpoints = (values[1:] + values[:-1]) / 2
        probe = torch.cat([values, midpoints, midpoints.nextafter(values[1:]), midpoints.nextafter(values[:-1])])
        probe = probe[probe.abs() <= 448]
        blocks = torch.nn.functional.pad(probe, (0, -probe.numel() % (BLOCK - 1))).view(-1, BLOCK - 1)
        anchored = torch.cat([torch.full((blocks.shape[0], 1), 448.0), blocks], dim=1).flatten()
        mine = (anchored if rank == 0 else torch.zeros_like(anchored)).to(device or "cpu")
        expected = reference([anchored] + [torch.zeros_like(anchored)] * (world_size - 1), "fp8")
        seen["e4m3"] = all(same_bits(comm.all_reduce(mine, wire="fp8", path=path).cpu(), expected) for path in paths)
        seen["e4m3_count"] = int(probe.numel())
    return seen


def table_wires(
    rank: int, world_size: int, socket: str, group: str, kwargs: dict, sizes: list[int], report, commands
) -> dict:
    """The table's wire per range, and the wire each size's all-reduce took (by its bits); the
    group is held until the test has read the daemon's counts ("stop" on `commands`)."""
    with nodecomm.connect(group, rank, world_size, socket=socket, timeout=30, **kwargs) as comm:
        table = comm.thresholds()
        took = {}
        for size in sizes:
            inputs = [activations(r, size // 4, torch.float32, size) for r in range(world_size)]
            y = comm.all_reduce(inputs[rank])
            took[size] = next(
                (wire for wire in ("int8", "fp8") if same_bits(y, reference(inputs, wire))),
                "lossless" if same_bits(y, rank_order_sum(inputs)) else "neither",
            )
        report.put(rank)
        assert commands.get(timeout=120) == "stop"
        return {
            "wire": table.wire.value,
            "ranges": [
                (lo, hi, path.value, wire.value)
                for (lo, hi, path), wire in zip(table.rows(), table.wires(), strict=True)
            ],
            "took": took,
        }


def disagree_on_wire(rank: int, world_size: int, socket: str) -> str:
    """Rank 1 sends int8 where the others send lossless: every rank's error; then a call that agrees."""
    with nodecomm.connect("wire-mismatch", rank, world_size, socket=socket, timeout=30) as comm:
        try:
            comm.all_reduce(torch.ones(1024), wire="int8" if rank == 1 else "lossless", path="oneshot")
            message = "no error"
        except nodecomm.GroupMismatchError as error:
            message = str(error)
        after = comm.all_reduce(torch.ones(1024), wire="fp8")[0].item()
        return f"{message} | after {after}"


def live_wire_switch(rank: int, world_size: int, socket: str, synthetic: list, calls: int) -> dict:
    """Join with wire="int8", stream synthetic timings (path, bytes, seconds, wire), then
    all-reduce 16 KiB `calls` times: the call at which the table changed, its ranges and wires."""
    from nodecomm.thresholds import Path, Wire

    with nodecomm.connect("live-wire", rank, world_size, socket=socket, timeout=30, wire="int8") as comm:
        first_epoch = comm.thresholds().epoch
        initial = comm.thresholds().boundary("compressed_min_bytes").describe()
        for path, nbytes, seconds, wire in synthetic:
            # what sampled operations send
            comm._session.report(Path(path).to_proto(), nbytes, seconds, Wire(wire).to_proto())
        comm._session.flush()
        switched_at = None
        x = torch.ones(4096)
        for call in range(calls):
            comm.all_reduce(x)
            if switched_at is None and comm.thresholds().epoch != first_epoch:
                switched_at = call
            time.sleep(0.002)  # not a wait: the calls are paced to span the daemon's answer to the timings
        table = comm.thresholds()
        rows = [(lo, hi, p.value, w.value) for (lo, hi, p), w in zip(table.rows(), table.wires(), strict=True)]
        boundary = table.boundary("compressed_min_bytes").describe()
        return {"switched_at": switched_at, "rows": rows, "initial": initial, "boundary": boundary}


def compressed_in_graphs(rank: int, world_size: int, socket: str, device: str) -> list[str]:
    """A CUDA group: every path on both wires captured in one graph, replayed with new inputs
    without a host synchronisation between replays; then eager calls cycling lossless and
    compressed paths back to back. Returns the problems found."""
    device = _device(rank, device)
    problems = []
    count, dtype = 70_001, torch.bfloat16
    calls = [(path, wire) for wire in ("int8", "fp8") for path in ("oneshot", "twoshot", "dma")]
    with _group("wire-graphs", rank, world_size, socket, device) as comm:
        inputs = [[activations(r, count, dtype, 200 + k) for r in range(world_size)] for k in range(4)]
        static_in = torch.empty(count, dtype=dtype, device=device)
        static_out = {call: torch.empty_like(static_in) for call in calls}
        graph = torch.cuda.CUDAGraph()
        capture_stream = torch.cuda.Stream()
        with torch.cuda.stream(capture_stream), torch.cuda.graph(graph, stream=capture_stream):
            for (path, wire), out in static_out.items():
                comm.all_reduce(static_in, out=out, path=path, wire=wire)
        history = []
        for k in range(4):
            static_in.copy_(inputs[k][rank])
            graph.replay()
            history.append({call: out.clone() for call, out in static_out.items()})
        cycled = [
            comm.all_reduce(inputs[k][rank].to(device), path=path, wire=wire)
            for k in range(4)
            for path in ("oneshot", "twoshot", "dma")
            for wire in ("lossless", "int8")
        ]
        torch.cuda.synchronize()
        for k in range(4):
            for (path, wire), got in history[k].items():
                if not same_bits(got.cpu(), reference(inputs[k], wire)):
                    problems.append(f"graph replay {k}: {path} over {wire} differs from the reference")
        expected = {
            wire: [reference(inputs[k], wire) if wire != "lossless" else rank_order_sum(inputs[k]) for k in range(4)]
            for wire in ("lossless", "int8")
        }
        for index, got in enumerate(cycled):
            k, path, wire = index // 6, ("oneshot", "twoshot", "dma")[index // 2 % 3], ("lossless", "int8")[index % 2]
            if not same_bits(got.cpu(), expected[wire][k]):
                problems.append(f"back-to-back call {index} ({path} over {wire}) differs")
    return problems


def check_special_blocks(seen: dict) -> None:
    """special_blocks' findings, alike on every device: inf, -inf and NaN on rank 0 are NaN in the
    sum, the rest of their blocks exact (ones); a zero block stays zero; every E4M3 code decodes."""
    assert seen[0] == seen[1]
    for wire in ("int8", "fp8"):
        assert seen[0][wire]["nan"] == [5, 2 * 32 + 7, 3 * 32 + 1], wire
        assert seen[0][wire]["zero_block"] == [0.0] * 32, wire
        assert seen[0][wire]["block_rest"] == [2.0] * 31, wire
    assert seen[0]["e4m3"] is True and seen[0]["e4m3_count"] > 1000
