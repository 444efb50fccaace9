"""The `nodecomm` command: status, thresholds and bench against the node's daemon."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

import grpc
from tabulate import tabulate

from nodecomm._native import MAX_RANKS
from nodecomm.byte_size import format_byte_size, parse_byte_size
from nodecomm.capabilities import path_names
from nodecomm.daemon_channel import open_channel
from nodecomm.errors import NodecommError, from_rpc_error
from nodecomm.socket_path import default_socket_path
from nodecomm.thresholds import PEER_PATHS, DispatchTable, Path, Wire, range_end
from nodecomm.trust import node_daemon_uids
from nodecomm.v1 import control_pb2 as pb
from nodecomm.v1 import control_pb2_grpc as pb_grpc

from .calibration_plot import point_name


def _stub(socket: str | None, timeout: float) -> tuple[grpc.Channel, pb_grpc.ControlStub]:
    """A channel to the node daemon at `socket` (default: its default path), once it has proved
    who it is (nodecomm.daemon_channel)."""
    path = socket or default_socket_path()
    channel, _ = open_channel(path, node_daemon_uids(path), timeout)
    return channel, pb_grpc.ControlStub(channel)


def cmd_status(args: argparse.Namespace) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        channel, stub = _stub(args.socket, args.timeout)
        with channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
            # The daemon shows a caller its own groups, and an operator every group.
            groups = stub.ListGroups(pb.ListGroupsRequest(), timeout=args.timeout).groups
    except (grpc.RpcError, NodecommError) as error:
        if not args.json:
            raise
        # A script asked for JSON: it gets JSON, with why there is no daemon to report.
        reason = from_rpc_error(error) if isinstance(error, grpc.RpcError) else error
        print(json.dumps({"health": "UNREACHABLE", "error": str(reason), "groups": []}, indent=2))
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
    # Non-zero unless serving, so that probes and scripts can use the exit status alone.
    code = 0 if health.status == health_pb2.HealthCheckResponse.SERVING else 1
    if args.json:
        print(
            json.dumps(
                {
                    "health": status,
                    "groups": [
                        {
                            "name": g.name,
                            "owner": g.owner or None,  # shown to operators
                            "group_id": g.group_id,
                            "state": g.state,
                            "world_size": g.world_size,
                            "device_kind": g.device_kind,
                            "joined_ranks": list(g.joined_ranks),
                            "live_ranks": list(g.live_ranks),
                            "reserved_bytes": g.reserved_bytes,
                            "service_bytes": g.service_bytes,
                            "service_ordering": _ORDERING_NAMES.get(g.service_ordering),
                            "topk_exchanges": g.topk_exchanges,
                            "capacity_bytes": g.geometry.capacity_bytes,
                            "paths": _paths_summary(g.thresholds) if g.thresholds.ranges else None,
                            "captured": _captured(g),
                        }
                        for g in groups
                    ],
                },
                indent=2,
            )
        )
        return code
    print(f"daemon: {status} ({args.socket or default_socket_path()})")
    if not groups:
        print("(no groups)")
        return code
    rows = [
        [
            g.name + (f" [{g.owner}]" if g.owner else ""),  # the owner: shown to operators
            g.state,
            g.device_kind,
            g.world_size,
            ",".join(map(str, g.live_ranks)) or "-",
            format_byte_size(g.reserved_bytes),
            format_byte_size(g.service_bytes),
            _ORDERING_NAMES.get(g.service_ordering, "-"),
            g.topk_exchanges,
            _paths_summary(g.thresholds) if g.thresholds.ranges else "-",
        ]  # fmt: skip
        for g in groups
    ]
    headers = ["group", "state", "device", "world", "live ranks", "reserved", "service", "ordering", "topk", "paths"]
    print(
        tabulate(rows, headers, tablefmt="plain", colalign=("left",) * 5 + ("right",) * 2 + ("left", "right", "left"))
    )
    for g in groups:
        moved = [c for c in _captured(g) if c["path"] != c["table_path"]]
        if moved:
            sizes = ", ".join(
                f"{format_byte_size(c['bytes'])} on {c['path']} (table: {c['table_path']})" for c in moved
            )
            print(f"{g.name}: captured on a path the table no longer gives (re-capture to move): {sizes}")
    return code


def _captured(group: pb.GroupInfo) -> list[dict]:
    """The sizes a group's ranks captured in CUDA graphs: the path each replays on and the path
    the table in force gives it."""
    if not group.captured or not group.thresholds.ranges:
        return []
    table = DispatchTable.from_proto(group.thresholds)
    return [
        {"bytes": c.bytes, "path": Path.from_proto(c.path).value, "table_path": table.path_for(c.bytes).value}
        for c in group.captured
    ]


# How a CUDA group's service path orders its streams (DaemonConfig.cuda_service_ordering's names).
_ORDERING_NAMES = {pb.STREAM_WORDS: "stream-words", pb.IPC_EVENTS: "ipc-events"}


def _paths_summary(table: pb.ThresholdTable) -> str:
    """'oneshot <=256KiB, twoshot <6MiB, dma': each range's path and where it ends."""
    dispatch = DispatchTable.from_proto(table)
    ends = [
        f"{path.value} {range_end(high)}"
        for high, path in zip(dispatch.range_max, dispatch.range_paths[:-1], strict=True)
    ]
    return ", ".join([*ends, dispatch.range_paths[-1].value])


def cmd_thresholds(args: argparse.Namespace) -> int:
    if args.nccl and args.device != "cuda":
        print("nodecomm thresholds: --nccl applies to --device cuda (CPU groups have no NCCL path)", file=sys.stderr)
        return 2
    channel, stub = _stub(args.socket, args.timeout)
    with channel:
        # A group's name is looked up among the caller's own groups.
        request = pb.GetThresholdsRequest(group=args.group or "", device_kind=args.device, nccl_fallback=args.nccl)
        table = DispatchTable.from_proto(stub.GetThresholds(request, timeout=args.timeout))
    if args.json:
        print(
            json.dumps(
                {
                    "epoch": table.epoch,
                    "origin": table.origin,
                    "wire": table.wire.value,
                    "ranges": [
                        {"from": lo, "to": hi, "path": path.value, "wire": wire.value}
                        for (lo, hi, path), wire in zip(table.rows(), table.wires(), strict=True)
                    ],
                    "boundaries": [
                        {"name": b.name, "value_bytes": b.value_bytes, "source": b.source.value}
                        for b in table.boundaries
                    ],
                },
                indent=2,
            )
        )
        return 0
    if args.group:
        subject = f"group {args.group}"
    else:
        subject = f"new {args.device.upper()} groups" + (" with an NCCL group" if args.nccl else "")
    print(f"dispatch table (epoch {table.epoch}) for {subject}")
    _print_table(table)
    if table.origin:
        print(f"  from: {table.origin}")
    return 0


def _print_table(table: DispatchTable) -> None:
    for (sizes, path), wire in zip(table.labels(), table.wires(), strict=True):
        carried = path.value if wire is Wire.LOSSLESS else f"{path.value}, {wire.value} wire"
        print(f"  {sizes:<24} -> {carried}")
    for boundary in table.boundaries:
        print(f"  {boundary.describe()}")


def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.max_bytes is not None and args.min_bytes > args.max_bytes:
        print(
            f"nodecomm calibrate: --min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}",
            file=sys.stderr,
        )
        return 2
    channel, stub = _stub(args.socket, args.timeout)
    request = pb.CalibrateRequest(
        device_kind=args.device,
        world_size=args.world_size,
        min_bytes=args.min_bytes,
        max_bytes=args.max_bytes or parse_byte_size(DEFAULT_MAX[args.device]),
        wires=[pb.Wire.Value(w.strip().upper()) for w in (args.wire or "").split(",") if w.strip()],
    )
    ranks = f"{args.world_size} probe ranks" if args.world_size else "the daemon's probe ranks"
    print(
        f"calibrating {args.device} paths: {format_byte_size(request.min_bytes)} .. "
        f"{format_byte_size(request.max_bytes)}, {ranks} ...",
        flush=True,
    )
    reply = None
    with channel:
        for update in stub.Calibrate(request, timeout=args.probe_timeout):
            if update.WhichOneof("kind") == "done":
                reply = update.done
            elif not args.json:
                point = update.point
                name = point_name(point)
                print(
                    f"  measured {format_byte_size(point.bytes):>8} {name:<8} {point.seconds * 1e6:10.1f}us", flush=True
                )
    if reply is None:
        print("nodecomm calibrate: the daemon ended the stream without a result", file=sys.stderr)
        return 1
    table = DispatchTable.from_proto(reply.thresholds)
    for warning in reply.warnings:
        print(f"nodecomm calibrate: {warning}", file=sys.stderr)
    if args.plot:
        from nodecomm.tools.calibration_plot import plot_calibration

        plot_calibration(reply, table, args.plot)
    if args.json:
        points = [
            {
                "path": pb.Path.Name(p.path).lower(),
                "wire": pb.Wire.Name(p.wire).lower(),
                "bytes": p.bytes,
                "seconds": p.seconds,
            }
            for p in reply.points
        ]
        document = {
            "fingerprint_key": reply.fingerprint_key,
            "stored_at": reply.stored_at,
            "boundaries": [
                {"name": b.name, "value_bytes": b.value_bytes, "source": b.source.value} for b in table.boundaries
            ],
            "points": points,
            "warnings": list(reply.warnings),
        }
        print(json.dumps(document, indent=2))
        return 1 if reply.warnings else 0
    print(f"{'size':>10} " + " ".join(f"{name:>12}" for name in sorted({point_name(p) for p in reply.points})))
    by_size: dict[int, dict[str, float]] = {}
    for point in reply.points:
        by_size.setdefault(point.bytes, {})[point_name(point)] = point.seconds
    for size, times in sorted(by_size.items()):
        cells = " ".join(f"{times[name] * 1e6:>10.1f}us" for name in sorted(times))
        print(f"{format_byte_size(size):>10} {cells}")
    if reply.warnings:
        print("not calibrated; the table in force:")
        _print_table(table)
        return 1
    print(f"calibrated (fingerprint {reply.fingerprint_key}, stored in {reply.stored_at}):")
    _print_table(table)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
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
    from nodecomm.tools.bench import (
        BASELINES,
        BenchSetup,
        format_header,
        format_rows,
        format_trailer,
        run_bench,
        sizes_between,
        write_json,
    )

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
    print("\n".join(format_header(setup)), flush=True)
    rows, notes = run_bench(
        setup, args.socket, lambda size_rows: print("\n".join(format_rows(size_rows, setup)), flush=True)
    )
    trailer = format_trailer(rows, notes, args.device)
    print("\n".join(trailer))
    if any(line.startswith("# NOISE") for line in trailer):
        print("nodecomm bench: the figures are noise (see the table's trailer): the machine was busy", file=sys.stderr)
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


def cmd_topo(args: argparse.Namespace) -> int:
    from nodecomm import _native
    from nodecomm.tools.topology import format_topology, node_topology, why_no_gpu

    devices = _native.cuda_devices() if _native.WITH_CUDA else []
    topology = node_topology(devices, _native.cuda_peer_links() if devices else [])
    reason = "" if devices else why_no_gpu(_native.WITH_CUDA)
    if args.json:
        print(json.dumps({**topology.to_json(), **({"no_gpu_reason": reason} if reason else {})}, indent=2))
    else:
        print(format_topology(topology, reason))
    return 0


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
DEFAULT_MAX = {"cpu": "64MiB", "cuda": "256MiB"}


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds greater than 0."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds, e.g. 5") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds greater than 0")
    return seconds


def byte_size(text: str) -> int:
    """An argparse type: a byte size (parse_byte_size's forms, not "off"), at least 1."""
    expected = f"{text!r}: expected a size of at least 1 byte, e.g. 4KiB or 1048576 (K, M, G: 1024-based)"
    try:
        size = parse_byte_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(expected) from None
    if size is None or size < 1:
        raise argparse.ArgumentTypeError(expected)
    return size


def byte_sizes(text: str) -> list[int]:
    """An argparse type: comma-separated byte sizes."""
    return sorted({byte_size(part.strip()) for part in text.split(",") if part.strip()}) or [byte_size("")]


def whole_number(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: one whole number from `minimum` (to `maximum`)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"from {minimum} to {maximum}" if maximum is not None else f"{minimum} or more"
            raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number {bound}")
        return value

    return parse


def whole_numbers(minimum: int) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated whole numbers, each at least `minimum`."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(value) for value in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated whole numbers, e.g. 2,2") from None
        if min(values) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: expected every number to be {minimum} or more")
        return values

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nodecomm", description="Inspect and measure the node's nodecomm daemon.")
    parser.add_argument("--socket", help="daemon socket (default: $NODECOMM_SOCKET or the daemon's default path)")
    parser.add_argument(
        "--timeout", type=positive_seconds, default=5.0, help="seconds to wait for the daemon (default: 5)"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    status = commands.add_parser("status", help="daemon health and its groups")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.set_defaults(run=cmd_status)

    thresholds = commands.add_parser("thresholds", help="the dispatch table in force")
    thresholds.add_argument("--group", help="a formed group's table (default: the table for new groups)")
    thresholds.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="new groups of this kind")
    thresholds.add_argument("--nccl", action="store_true", help="new CUDA groups whose ranks pass an NCCL group")
    thresholds.add_argument("--json", action="store_true", help="print JSON instead of a table")
    thresholds.set_defaults(run=cmd_thresholds)

    topo = commands.add_parser("topo", help="this node's GPUs, their links, and the paths each pair can use")
    topo.add_argument("--json", action="store_true", help="print JSON instead of a table")
    topo.set_defaults(run=cmd_topo)

    calibrate = commands.add_parser("calibrate", help="measure where each path stops winning; persist and use it")
    calibrate.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    calibrate.add_argument(
        "--world-size",
        type=whole_number(2, MAX_RANKS),
        default=0,
        help=f"probe ranks, 2 to {MAX_RANKS} (default: 2 on the CPU, one per GPU)",
    )
    calibrate.add_argument("--min-bytes", type=byte_size, default="4KiB", help="smallest size probed (default: 4KiB)")
    calibrate.add_argument(
        "--max-bytes", type=byte_size, help="largest size probed (default: 64MiB on the CPU, 256MiB on GPUs)"
    )
    calibrate.add_argument(
        "--probe-timeout", type=positive_seconds, default=3600.0, help="seconds to wait for the probe (default: 3600)"
    )
    calibrate.add_argument(
        "--wire",
        choices=("int8", "fp8", "int8,fp8", "fp8,int8"),
        metavar="WIRES",
        help="also time these compressed wires (int8, fp8 or both, comma-separated), placing compressed_min_bytes "
        "for the groups that ask for them",
    )
    calibrate.add_argument("--json", action="store_true", help="print the result as JSON")
    calibrate.add_argument("--plot", metavar="PNG", help="also draw latency against size per path (needs matplotlib)")
    calibrate.set_defaults(run=cmd_calibrate)

    bench = commands.add_parser(
        "bench", help="all-reduce latency and bandwidth per path, beside gloo (CPU) or NCCL (GPU)"
    )
    bench.add_argument(
        "--op",
        default="all_reduce",
        choices=("all_reduce", "topk", "topk-merge", "wire-error", "across-nodes", "convergence", "rms-norm"),
        help="wire-error: the compressed wires' error against the exact sum (docs/compressed-wires.md); "
        "convergence: the calls a fresh group's table needs to pick each size's fastest path; "
        "rms-norm: all_reduce_rms_norm against all_reduce and torch's add and RMSNorm",
    )
    bench.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    bench.add_argument(
        "--rows",
        type=whole_numbers(0),
        help="topk: rows per stage (default: 64,256,1024,2048); topk-merge: rows per merge (default: 1,16,256,2048,"
        "8192; CPU 1,16,64); rms-norm: tokens per call (default: 1,2,4,...,8192)",
    )
    bench.add_argument(
        "--hidden", type=whole_numbers(1), default="4096,8192", help="rms-norm: hidden sizes (default: 4096,8192)"
    )
    bench.add_argument(
        "--worlds", type=whole_numbers(1), default="2,4,8", help="wire-error: the world sizes, divisors of 8"
    )
    bench.add_argument(
        "--nodes", type=whole_numbers(1), default="2,2", help="across-nodes: ranks per stand-in node (a daemon each)"
    )
    bench.add_argument("--count", type=whole_number(1), default=1 << 18, help="wire-error: Gaussian elements per rank")
    bench.add_argument(
        "--topk", type=whole_number(1), default=2048, help="topk, topk-merge: candidates per row and rank"
    )
    bench.add_argument(
        "--iterations",
        type=whole_number(1),
        help="topk, topk-merge: timed calls per size (default: 10); rms-norm: calls (50)",
    )
    bench.add_argument(
        "--calls", type=whole_number(50), default=3000, help="convergence: default-dispatched calls per size"
    )
    bench.add_argument(
        "--explore-period",
        type=whole_number(0),
        help="convergence: the private daemon's explore_period (default: the daemon's own)",
    )
    bench.add_argument(
        "--table",
        choices=tuple(path.value for path in PEER_PATHS),
        help="convergence: start from a stored calibration that sends every size to this path (a wrong table)",
    )
    bench.add_argument(
        "--world-size", type=whole_number(1, MAX_RANKS), default=2, help=f"ranks, 1 to {MAX_RANKS} (default: 2)"
    )
    bench.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="element type")
    bench.add_argument("--min-bytes", type=byte_size, default="1KiB", help="smallest size (default: 1KiB)")
    bench.add_argument("--max-bytes", type=byte_size, help="largest size (default: 64MiB on the CPU, 256MiB on GPUs)")
    bench.add_argument(
        "--sizes", type=byte_sizes, help="comma-separated sizes to measure instead of --min-bytes .. --max-bytes"
    )
    bench.add_argument(
        "--paths",
        help="comma-separated: oneshot, twoshot, service, dma (GPU), auto, torch (dist.all_reduce through the "
        "nodecomm backend), inplace (what torch runs underneath, called directly), gloo / nccl "
        "(default: every path and auto)",
    )
    bench.add_argument(
        "--wire",
        help="comma-separated compressed wires (int8, fp8) to time beside lossless on every path that carries "
        "them (rows 'oneshot+int8', ...; #wrong counts ranks whose bits differ from rank 0's)",
    )
    bench.add_argument(
        "--capacity",
        type=byte_size,
        default="8MiB",
        help="the group's slot capacity, at least 64 bytes (larger payloads are chunked; default: 8MiB)",
    )
    bench.add_argument("--graph", action="store_true", help="GPU: time calls captured in CUDA graphs")
    bench.add_argument("--no-baseline", action="store_true", help="skip the gloo / NCCL baseline")
    bench.add_argument(
        "--progress",
        action="store_true",
        help="also print each path's result as a JSON line the moment it is measured (table rows print per size)",
    )
    bench.add_argument("--json", metavar="FILE", help="also write the table as JSON (-: one line on stdout)")
    bench.set_defaults(run=cmd_bench)
    return parser


def _off_main_thread(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`run(args)` on a thread of its own while the main thread only waits for it. Ctrl-C raises
    KeyboardInterrupt in the main thread at whatever line it is on; raised inside gRPC's Python
    layer (a call being set up) it can leave a channel that never closes, and the command hangs.
    Here Ctrl-C ends the process at once instead: the daemon sees the connection close and cancels
    what it was doing for this command."""

    def interrupted(signum: int, frame: object) -> None:
        print(f"nodecomm {args.command}: interrupted", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            sys.stdout.flush()
        os._exit(130)

    outcome: list[int | BaseException] = []
    done = threading.Event()

    def work() -> None:
        try:
            outcome.append(run(args))
        except BaseException as error:  # re-raised in the main thread, where main() reports it
            outcome.append(error)
        finally:
            done.set()

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        threading.Thread(target=work, name=f"nodecomm {args.command}", daemon=True).start()
        # In slices: the kernel may hand SIGINT to one of gRPC's threads, which does not wake a
        # main thread blocked on a lock; Python runs the handler when the main thread next wakes.
        while not done.wait(0.1):
            pass
    finally:
        signal.signal(signal.SIGINT, previous)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


# Options whose value may be written negative: argparse takes "-4KiB" after them for an option,
# and says only "expected one argument"; joined as "--sizes=-4KiB", the value gets its own message.
_SIZE_OPTIONS = ("--sizes", "--min-bytes", "--max-bytes", "--capacity")


def _joined_sizes(argv: Sequence[str]) -> list[str]:
    joined, rest = [], list(argv)
    while rest:
        item = rest.pop(0)
        if item in _SIZE_OPTIONS and rest and rest[0][:1] == "-" and rest[0][1:2].isdigit():
            item = f"{item}={rest.pop(0)}"
        joined.append(item)
    return joined


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(_joined_sizes(sys.argv[1:] if argv is None else argv))
    try:
        # bench runs on the main thread: its own cleanup (ranks, private daemon) runs on Ctrl-C.
        status = args.run(args) if args.command == "bench" else _off_main_thread(args.run, args)
        sys.stdout.flush()  # inside the try: a closed pipe surfaces here, not at exit
        return status
    except BrokenPipeError:
        # The reader went away (`nodecomm status | head -1`): stop quietly, as other CLIs do. Python
        # would report the pipe again when it flushes stdout at exit, unless stdout goes nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"nodecomm {args.command}: interrupted", file=sys.stderr)
        return 130
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.CANCELLED and isinstance(sys.exc_info()[1].__context__, KeyboardInterrupt):
            print(f"nodecomm {args.command}: interrupted", file=sys.stderr)
            return 130
        print(f"nodecomm {args.command}: {from_rpc_error(error)}", file=sys.stderr)
        return 1
    except (NodecommError, ValueError, RuntimeError, TimeoutError) as error:
        print(f"nodecomm {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
