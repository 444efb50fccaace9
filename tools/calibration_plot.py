"""`nodecomm calibrate --plot`: each path's measured latency against message size, with the
boundaries the daemon placed, as a PNG (matplotlib, the optional `plot` extra)."""

from __future__ import annotations

from nodecomm.byte_size import format_byte_size
from nodecomm.thresholds import DispatchTable
from nodecomm.v1 import control_pb2 as pb


def point_name(point: pb.CalibrationPoint) -> str:
    """'oneshot', or 'oneshot+int8' for a point timed over a compressed wire."""
    name = pb.Path.Name(point.path).lower()
    return name if point.wire == pb.LOSSLESS else f"{name}+{pb.Wire.Name(point.wire).lower()}"


def plot_calibration(reply: pb.CalibrateReply, table: DispatchTable, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'nodecomm[plot]'") from None
    series: dict[str, list[tuple[int, float]]] = {}
    for point in reply.points:
        series.setdefault(point_name(point), []).append((point.bytes, point.seconds * 1e6))
    figure, axes = plt.subplots(figsize=(8, 5))
    for name, values in sorted(series.items()):
        sizes, micros = zip(*sorted(values), strict=True)
        axes.plot(sizes, micros, marker="o", label=name)
    for boundary in table.boundaries:
        if boundary.value_bytes is not None:
            axes.axvline(boundary.value_bytes, linestyle="--", color="gray")
            axes.annotate(boundary.describe(), (boundary.value_bytes, axes.get_ylim()[1]), rotation=90, va="top")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    ticks = sorted({size for values in series.values() for size, _ in values})
    axes.set_xticks(ticks, [format_byte_size(t) for t in ticks], rotation=45)
    axes.set_xlabel("message size")
    axes.set_ylabel("slowest rank's median latency (us)")
    axes.set_title(f"nodecomm calibration {reply.fingerprint_key}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)
