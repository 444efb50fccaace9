"""What `nodecomm bench` prints and writes: its header, a table row per size and path in
nccl-tests' units, the trailer (dispatch regret, the torch backend's overhead, the noise guard)
and the JSON."""

from __future__ import annotations

import itertools
import json
import os
import platform
from dataclasses import asdict

from nodecomm.byte_size import format_byte_size

from .bench import BACKEND_ROW, BASELINES, DIRECT_ROW, NODECOMM_PATHS, BenchSetup, Row, describe_machine


def format_header(setup: BenchSetup, socket: str | None) -> list[str]:
    """The table's first lines: what ran, on what machine, through which daemon (`socket`, or the
    private one the bench starts without it)."""
    name = setup.baseline or BASELINES[setup.device]
    daemon = f"the daemon at {socket}" if socket else "a private daemon of its own (--socket S for another)"
    lines = [
        f"# nodecomm bench: {setup.describe()} {describe_machine(setup.device)}",
        f"# through {daemon}",
        f"# time: slowest rank per iteration; busbw = algbw * 2(n-1)/n; vs {name}: p50 latency ratio and busbw ratio",
        "#",
        f"# {'size':>9} {'count':>10} {'type':>8} {'path':>12} {'p50(us)':>10} {'p99(us)':>10} "
        f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6} {'lat/' + name:>9} {'bw/' + name:>8}",
    ]
    if setup.baseline is None:
        shared = setup.device == "cuda" and setup.world_size > setup.gpus
        why = "NCCL refuses ranks that share a GPU" if shared else "--no-baseline"
        lines.insert(3, f"# no {name} baseline in this run ({why})")
    return lines


def format_rows(rows: list[Row], setup: BenchSetup) -> list[str]:
    """Table lines for rows; a row's ratios need its size's baseline row among them."""
    name = setup.baseline or BASELINES[setup.device]
    baseline = {r.size_bytes: r for r in rows if r.path == name}
    lines = []
    for r in rows:
        base = baseline.get(r.size_bytes)
        lat = f"{r.p50_us / base.p50_us:9.3f}" if base and r.path != name else f"{'':9}"
        bw = f"{r.busbw_gbps / base.busbw_gbps:8.2f}" if base and r.path != name and base.busbw_gbps else f"{'':8}"
        lines.append(
            f"  {format_byte_size(r.size_bytes):>9} {r.count:>10} {r.dtype:>8} {r.label:>12} {r.p50_us:>10.1f} "
            f"{r.p99_us:>10.1f} {r.algbw_gbps:>11.3f} {r.busbw_gbps:>11.3f} {r.wrong:>6} {lat} {bw}"
        )
    return lines


def format_trailer(rows: list[Row], notes: list[str] = (), device: str = "cpu") -> list[str]:
    return [
        *(f"# {note}" for note in notes),
        *dispatch_regret(rows),
        *backend_overhead(rows),
        *noise_lines(rows, device),
    ]


def noise_lines(rows: list[Row], device: str) -> list[str]:
    """What calibration's noise guard (service/calibration/probe.py) finds in these rows: the points whose
    figures do not compare paths (ranks starved of CPU, iterations spread past their median, a
    jump between sizes no machine makes), said where they would otherwise read as results."""
    from nodecomm.service.calibration.probe import measured_from_rows

    # Calibration measures the paths whose ranks spin on peer memory: only those use a whole core
    # each on a quiet machine (the service path's ranks and the baselines' wait in the kernel).
    spinning = [asdict(r) for r in rows if r.path in ("oneshot", "twoshot", "dma", "auto")]
    sizes = sorted({r["size_bytes"] for r in spinning})
    doubling = all(b == 2 * a for a, b in itertools.pairwise(sizes))
    # The guard's jump between neighbours holds for sizes that double; others are looked at alone.
    groups = [spinning] if doubling else [[r for r in spinning if r["size_bytes"] == size] for size in sizes]
    noise = [text for group in groups for text in measured_from_rows(group, device).noise()]
    if not noise:
        return []
    return [
        f"# NOISE: {len(noise)} point(s) whose timings varied too much to compare paths (another load on the "
        "machine, or more spinning ranks than free cores; calibrate refuses such points): run again on a quieter "
        "machine or with fewer ranks",
        *(f"#   {text}" for text in noise[:8]),
        *([f"#   and {len(noise) - 8} more"] if len(noise) > 8 else []),
    ]


def backend_overhead(rows: list[Row]) -> list[str]:
    """Per size, what dist.all_reduce through the backend costs beyond the same work done directly
    (the inplace row): torch.distributed's dispatch and the process group's own Python."""
    direct = {r.size_bytes: r for r in rows if r.path == DIRECT_ROW}
    lines = [
        f"#   {format_byte_size(r.size_bytes):>9} {r.p50_us - direct[r.size_bytes].p50_us:>8.1f} us"
        f"  ({r.p50_us / direct[r.size_bytes].p50_us:.2f}x)"
        for r in rows
        if r.path == BACKEND_ROW and r.size_bytes in direct
    ]
    return [f"# torch.distributed backend: p50({BACKEND_ROW}) - p50({DIRECT_ROW}) per size", *lines] if lines else []


def dispatch_regret(rows: list[Row]) -> list[str]:
    """Per size, auto's p50 over the best single path's (the baseline included): what the
    dispatch table costs against an oracle that knew this machine's winners."""
    by_size: dict[int, dict[str, Row]] = {}
    for r in rows:
        by_size.setdefault(r.size_bytes, {})[r.path] = r
    lines = []
    for size, paths in by_size.items():
        others = {n: r for n, r in paths.items() if n not in ("auto", BACKEND_ROW, DIRECT_ROW) and "+" not in n}
        if "auto" not in paths or not NODECOMM_PATHS & others.keys():
            continue  # no single path of nodecomm's to weigh the table against
        best = min(others.values(), key=lambda r: r.p50_us)
        lines.append(f"#   {format_byte_size(size):>9} {paths['auto'].p50_us / best.p50_us:>6.3f}  best {best.path}")
    header = (
        "# dispatch regret: auto p50 / best single path p50 per size (below 1: auto beat every single path's median)"
    )
    return [header, *lines] if lines else []


def write_json(path: str, rows: list[Row], setup: BenchSetup, notes: list[str] = ()) -> None:
    """The table as JSON in `path`; "-": one line on stdout (what the daemon's probe reads)."""
    document = {
        **asdict(setup),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "rows": [asdict(r) for r in rows],
        "notes": list(notes),
    }
    if path == "-":
        print(json.dumps(document), flush=True)
        return
    with open(path, "w") as handle:
        json.dump(document, handle, indent=2)
