"""The `nodecomm` commands that ask the node's daemon: status, thresholds and calibrate."""

from __future__ import annotations

import argparse
import json
import sys

import grpc
from tabulate import tabulate

from nodecomm.byte_size import format_byte_size, parse_byte_size
from nodecomm.daemon_channel import open_channel
from nodecomm.errors import NodecommError, from_rpc_error
from nodecomm.socket_path import default_socket_path
from nodecomm.thresholds import DispatchTable, Path, Wire, range_end
from nodecomm.trust import node_daemon_uids
from nodecomm.v1 import control_pb2 as pb
from nodecomm.v1 import control_pb2_grpc as pb_grpc

from .arguments import DEFAULT_MAX
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
