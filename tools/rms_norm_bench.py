"""nodecomm bench --op rms-norm: all_reduce_rms_norm beside the unfused sequence it replaces, in
one run: comm.all_reduce, then the residual add and torch.nn.functional.rms_norm (torch's kernels;
vLLM's fused_add_rms_norm where its compiled ops import). Rows are a tensor-parallel layer's
tokens; every call goes through the table's path. Time: the slowest rank's per call, p50, eager
(calls back to back) or inside replayed CUDA graphs; bits: whether the fused call matched the
stated reference (nodecomm.rms_norm) on every rank."""

from __future__ import annotations

import functools
import statistics

from .bench import cuda_times, describe_machine, host_times, run_ranks, slowest_rank, start_rank

EPS = 1e-6


def _vllm_add_rms_norm():
    """vLLM's fused_add_rms_norm (in place: residual += x, x = norm(residual) * weight), or None."""
    try:
        import torch
        import vllm._custom_ops  # noqa: F401 (registers torch.ops._C)

        return torch.ops._C.fused_add_rms_norm
    except Exception:  # vLLM absent or built for another torch: torch's kernels only
        return None


def _fused(comm, x, residual, weight, out, residual_out) -> None:
    comm.all_reduce_rms_norm(x, residual, weight, EPS, out=out, residual_out=residual_out)


def _unfused(comm, x, residual, weight, summed, added) -> None:
    import torch

    comm.all_reduce(x, out=summed)
    torch.add(summed, residual, out=added)
    torch.nn.functional.rms_norm(added, (weight.numel(),), weight, EPS)


def _unfused_vllm(comm, vllm_norm, x, residual, weight, summed) -> None:
    comm.all_reduce(x, out=summed)
    vllm_norm(summed, residual, weight, EPS)  # in place, as vLLM calls it


def _rank_main(rank: int, world_size: int, args: dict, port: int, report) -> object:
    device = start_rank(rank, world_size, args, port)
    import torch

    import nodecomm
    from nodecomm.rms_norm import add_rms_norm

    dtype = getattr(torch, args["dtype"])
    vllm_norm = _vllm_add_rms_norm() if device != "cpu" else None
    out_rows = []
    with nodecomm.connect(args["group"], rank, world_size, device=device, socket=args["socket"], timeout=60) as comm:
        for hidden in args["hidden"]:
            weight = torch.randn(hidden, generator=torch.Generator().manual_seed(7)).to(dtype).to(device)
            for rows in args["rows"]:
                generator = torch.Generator().manual_seed(rank * 1000 + rows)
                x = torch.randn(rows, hidden, generator=generator).to(dtype).to(device)
                residual = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)).to(dtype).to(device)
                out, residual_out, summed = (torch.empty_like(x) for _ in range(3))

                runs = {
                    "fused": functools.partial(_fused, comm, x, residual, weight, out, residual_out),
                    "torch": functools.partial(_unfused, comm, x, residual, weight, summed, torch.empty_like(x)),
                }
                if vllm_norm is not None:
                    runs["vllm"] = functools.partial(
                        _unfused_vllm, comm, vllm_norm, x, residual.clone(), weight, summed
                    )
                runs["fused"]()
                reduced = comm.all_reduce(x)
                want_out, want_residual = add_rms_norm(reduced, residual, weight, EPS)
                wrong = int(not (torch.equal(out.cpu(), want_out) and torch.equal(residual_out.cpu(), want_residual)))
                for name, run in runs.items():
                    for _ in range(10):  # warm: the first configuration timed otherwise pays for the process's start
                        run()
                    if device == "cpu":
                        times = host_times(run, args["iterations"], comm)
                    else:
                        times = cuda_times(run, args["iterations"], comm, graph=args["graph"])
                    slowest, flaws, _ = slowest_rank(times, wrong if name == "fused" else 0, world_size)
                    if rank == 0:
                        out_rows.append((hidden, rows, name, statistics.median(slowest), flaws))
    return out_rows if rank == 0 else None


def run_rms_norm_bench(
    world_size: int, rows_list: list[int], hidden_list: list[int], dtype: str, iterations: int,
    socket: str | None, device: str, graph: bool,
) -> str:  # fmt: skip
    gpus = 0
    if device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    args = {
        "rows": rows_list, "hidden": hidden_list, "dtype": dtype, "iterations": iterations, "device": device,
        "graph": graph and device == "cuda",
    }  # fmt: skip
    flags = ("--allow-shared-devices", "true") if device == "cuda" and world_size > gpus else ()
    raw = run_ranks(_rank_main, world_size, args, socket, flags)
    p50 = {(hidden, rows, name): seconds * 1e6 for hidden, rows, name, seconds, _ in raw}
    wrong = {(hidden, rows) for hidden, rows, name, _, flaws in raw if flaws}
    names = sorted({name for _, _, name, _, _ in raw} - {"fused"})
    mode = "graph" if args["graph"] else "eager"
    machine = describe_machine(device)
    header = f"# {'hidden':>6} {'rows':>6} {'fused(us)':>10} " + " ".join(
        f"{name + '(us)':>10} {name + '/fused':>12}" for name in names
    )
    lines = [
        f"# nodecomm bench --op rms-norm: device={device} world_size={world_size} dtype={dtype} mode={mode} {machine}",
        "# fused = all_reduce_rms_norm; torch = all_reduce, then add and torch.nn.functional.rms_norm; "
        "vllm = all_reduce, then vLLM's fused_add_rms_norm (where it loads)",
        "# time: slowest rank per call, p50; X/fused > 1: the fused call is faster; bits: fused against nodecomm.rms_norm",
        "#",
        f"{header} {'bits':>6}",
    ]
    for hidden in hidden_list:
        for rows in rows_list:
            fused = p50[(hidden, rows, "fused")]
            cells = " ".join(f"{p50[(hidden, rows, n)]:>10.1f} {p50[(hidden, rows, n)] / fused:>12.2f}" for n in names)
            bits = "WRONG" if (hidden, rows) in wrong else "exact"
            lines.append(f"  {hidden:>6} {rows:>6} {fused:>10.1f} {cells} {bits:>6}")
    return "\n".join(lines)
