"""`nodecomm bench`: every bench the command runs, its arguments checked before a daemon or a rank
starts."""

from __future__ import annotations

import argparse
import sys

from nodecomm.byte_size import format_byte_size, parse_byte_size
from nodecomm.capabilities import has_rank_environment, path_names

from .arguments import DEFAULT_MAX, byte_sizes

DEFAULT_BENCH_PATHS = {
    "cpu": ",".join([*path_names("cpu"), "service", "auto"]),
    "cuda": ",".join([*path_names("cuda"), "auto"]),
}
# What --paths may name on each device (tools/bench.py times them): the kind's paths, the
# daemon's, the table's, the two torch.distributed rows and the baseline.
BENCH_PATHS = {
    kind: (*path_names(kind), "service", "auto", "torch", "inplace", baseline)
    for kind, baseline in (("cpu", "gloo"), ("cuda", "nccl"))
}


def cmd_bench(args: argparse.Namespace) -> int:
    if not has_rank_environment():
        print(
            "nodecomm bench: its rank processes need torch, and nodecomm installed after it, which this environment "
            "lacks (a daemon-only install); run it where both are (the container image's with-torch target)",
            file=sys.stderr,
        )
        return 2
    if args.op == "wire-error":
        from nodecomm.tools.wire_error import run_wire_error

        if any(8 % world for world in args.worlds):
            print(
                f"nodecomm bench: --worlds {','.join(map(str, args.worlds))}: expected divisors of 8", file=sys.stderr
            )
            return 2
        print(run_wire_error(args.worlds, args.count, args.socket, args.device))
        return 0
    if args.op == "across-nodes":
        from nodecomm.tools.across_nodes_bench import run_across_nodes_bench

        sizes = args.sizes or byte_sizes("1KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB")
        if len(args.nodes) < 2:
            print(
                f"nodecomm bench: --nodes {args.nodes[0]}: expected two or more rank counts, e.g. 2,2", file=sys.stderr
            )
            return 2
        print(run_across_nodes_bench(args.nodes, sizes, args.iterations or 10))
        return 0
    if args.op == "convergence":
        from nodecomm.tools.convergence_bench import run_convergence_bench

        if args.table and args.socket:
            print("nodecomm bench: --table starts a daemon of its own; it cannot go with --socket", file=sys.stderr)
            return 2

        sizes = args.sizes or byte_sizes("4KiB,64KiB,1MiB" if args.device == "cpu" else "16KiB,1MiB,16MiB,64MiB")
        flags = () if args.explore_period is None else ("--explore-period", str(args.explore_period))
        print(run_convergence_bench(args.world_size, sizes, args.calls, args.socket, args.device, flags, args.table))
        return 0
    if args.op == "topk":
        from nodecomm.tools.topk_bench import run_topk_bench

        rows = args.rows or [64, 256, 1024, 2048]
        print(run_topk_bench(args.world_size, rows, args.topk, args.iterations or 10, args.socket, args.device))
        return 0
    if args.op == "topk-merge":
        from nodecomm.tools.topk_merge_bench import run_topk_merge_bench

        rows = args.rows or ([1, 16, 64] if args.device == "cpu" else [1, 16, 256, 2048, 8192])
        print(run_topk_merge_bench(args.world_size, rows, args.topk, args.iterations or 10, args.socket, args.device))
        return 0
    if args.op == "rms-norm":
        from nodecomm.tools.rms_norm_bench import run_rms_norm_bench

        rows = args.rows or [1 << k for k in range(14)]
        print(
            run_rms_norm_bench(
                args.world_size, rows, args.hidden, args.dtype, args.iterations or 50, args.socket, args.device,
                args.graph,
            )
        )  # fmt: skip
        return 0
    from nodecomm.tools.bench import BASELINES, BenchSetup, run_bench, sizes_between
    from nodecomm.tools.bench_report import format_header, format_rows, format_trailer, write_json

    gpus = 0
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0:
            print("nodecomm bench: --device cuda needs a visible GPU", file=sys.stderr)
            return 2
    paths = [p.strip() for p in (args.paths or DEFAULT_BENCH_PATHS[args.device]).split(",") if p.strip()]
    # Every argument is checked before a daemon or a rank starts.
    max_bytes = args.max_bytes or parse_byte_size(DEFAULT_MAX[args.device])
    known = BENCH_PATHS[args.device]
    unknown = [p for p in paths if p not in known]
    problem = (
        f"--paths {','.join(unknown)}: expected some of {', '.join(known)} for --device {args.device}"
        if unknown
        else f"--min-bytes {args.min_bytes} is larger than --max-bytes {max_bytes}"
        if not args.sizes and args.min_bytes > max_bytes
        else f"--capacity {args.capacity}: expected at least 64 bytes"
        if args.capacity < 64
        else ""
    )
    sizes = args.sizes or sizes_between(args.min_bytes, max_bytes)
    problem = problem or _sizes_problem(sizes, args.dtype, args.world_size, args.device, gpus)
    if problem:
        print(f"nodecomm bench: {problem}", file=sys.stderr)
        return 2
    # Each compressed wire asked for runs on every path that carries one, beside its lossless row.
    for wire in [w.strip() for w in (args.wire or "").split(",") if w.strip()]:
        if wire not in ("int8", "fp8"):
            print(f"nodecomm bench: --wire {wire!r}: expected int8 and/or fp8", file=sys.stderr)
            return 2
        paths += [f"{p}+{wire}" for p in list(paths) if p in ("oneshot", "twoshot", "dma", "auto")]
    baseline = BASELINES[args.device]
    # NCCL refuses ranks that share a GPU: with more ranks than GPUs the run has no baseline.
    if baseline not in paths and not args.no_baseline and (args.device == "cpu" or args.world_size <= gpus):
        paths.append(baseline)
    setup = BenchSetup(
        device=args.device,
        world_size=args.world_size,
        dtype=args.dtype,
        sizes=sizes,
        paths=paths,
        capacity_bytes=args.capacity,
        graph=args.graph,
        gpus=gpus,
        progress=args.progress,
    )
    if setup.graph and setup.device != "cuda":
        print("nodecomm bench: --graph applies to --device cuda", file=sys.stderr)
        return 2
    print("\n".join(format_header(setup, args.socket)), flush=True)
    rows, notes = run_bench(
        setup, args.socket, lambda size_rows: print("\n".join(format_rows(size_rows, setup)), flush=True)
    )
    trailer = format_trailer(rows, notes, args.device)
    print("\n".join(trailer))
    if any(line.startswith("# NOISE") for line in trailer):
        print(
            "nodecomm bench: the figures are noise (see the table's trailer): their timings varied too much to "
            "compare paths",
            file=sys.stderr,
        )
    if args.json:
        write_json(args.json, rows, setup, notes)
    return 1 if any(r.wrong for r in rows) else 0


# What a bench rank holds per size, in multiples of it: its input, output and expected sum, and
# the arange (int64) it builds them from: 5x for float32, 7x for 16-bit types.
_RANK_COPIES = {"float32": 5, "float16": 7, "bfloat16": 7}


def _sizes_problem(sizes: list[int], dtype: str, world_size: int, device: str, gpus: int) -> str:
    """Why the bench cannot measure these sizes ("" where it can): a size that is not whole elements,
    or, on the CPU, one whose tensors do not fit the host's available memory."""
    element = 4 if dtype == "float32" else 2
    odd = [format_byte_size(size) for size in sizes if size % element]
    if odd:
        return f"--sizes {','.join(odd)}: expected multiples of {element} bytes (one {dtype} element)"
    largest = max(sizes)
    if device == "cuda":
        return ""  # asking the GPUs would open a context on each here; a rank that cannot allocate says so
    ranks, free, where = world_size, _host_available(), "available on this host"
    needed = ranks * _RANK_COPIES[dtype] * largest
    if free is not None and needed > free:
        return (
            f"--sizes {format_byte_size(largest)}: {world_size} ranks need about {needed / (1 << 30):.1f} GiB for it "
            f"({_RANK_COPIES[dtype]}x the size a rank), and {free / (1 << 30):.1f} GiB is {where}"
        )
    return ""


def _host_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
