"""The calibration probe: the `nodecomm bench` rank programs run against this daemon in a
subprocess (so that the daemon never imports torch), every constructed path timed over a size
sweep; noisy runs are retried, and each measured point is streamed to the caller."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from nodecomm.byte_size import format_byte_size
from nodecomm.capabilities import DeviceKind, has_rank_environment, path_names
from nodecomm.errors import InternalError, UnsupportedError
from nodecomm.thresholds import Path
from nodecomm.v1 import control_pb2 as pb

log = logging.getLogger("nodecomm.calibration")


def start_probe(args: list[str]) -> subprocess.Popen:
    """Start a probe process, its output (stdout and stderr) on a pipe, in a session of its own so
    that it and its rank processes are killed together.

    subprocess, not the event loop's: uvloop starts children with fork(), which copies this
    multithreaded daemon and runs gRPC's fork handlers in the copy before exec; a few percent of
    such copies die with SIGSEGV while gRPC is busy (seen in CI: exit -11, no output). subprocess
    uses vfork() and exec, which run no fork handlers."""
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


# What each kind's probe times: its paths (nodecomm.capabilities); on GPUs in CUDA graphs, beside
# which the bench adds NCCL wherever every rank has a GPU of its own.
PROBE_FLAGS = {
    DeviceKind.CPU: ["--device", "cpu", "--paths", ",".join(path_names(DeviceKind.CPU)), "--no-baseline"],
    DeviceKind.CUDA: ["--device", "cuda", "--paths", ",".join(path_names(DeviceKind.CUDA)), "--graph"],
}


# A point is noise when the middle half of its iterations spans more than its median (the
# interquartile range over the median), or when its median and the next larger size's of the
# same path differ by more than NOISE_JUMP times either way: doubling a size moves an
# all-reduce's latency by at most ~2.5x on every machine measured (bench-cpu.md, bench-gpu.md),
# while loaded machines went far past both (docs/calibration-cpu.md, "What the probe calls noise").
NOISE_SPREAD = 1.0
NOISE_JUMP = 4.0
# CPU probes only: a point measured while its ranks, which spin on host memory and so use a
# whole core each on an idle machine, had less than this share of one is noise: the machine is
# busy, even where every iteration was slowed alike (loaded 2-core machine: 0.09-0.26; idle:
# 0.71-1.0).
NOISE_CPU_SHARE = 0.5
# A point measured as noise is measured again this many times (a burst on a quiet machine passes);
# noise that stays through them all refuses the calibration.
NOISE_RETRIES = 3


@dataclass(frozen=True)
class Measured:
    """What the probe measured: the slowest rank's median seconds and the relative interquartile
    range, per path and size, and the variant a path took where it has several (CUDA oneshot)."""

    medians: dict[str, dict[int, float]]
    spreads: dict[str, dict[int, float]]
    cpu_shares: dict[str, dict[int, float]] = field(default_factory=dict)  # CPU probes
    variants: dict[str, dict[int, str]] = field(default_factory=dict)

    def noisy_sizes(self) -> list[int]:
        """The sizes to measure again: those of noisy points, and both sizes of a jump."""
        return sorted({size for size, _ in self._noise()})

    def noise(self) -> list[str]:
        """The points too noisy to place a boundary by, described with their figures."""
        return list(dict.fromkeys(text for _, text in self._noise()))  # a jump is found at both its sizes

    def remeasured(self, again: Measured) -> Measured:
        """These measurements with the points measured `again` in their place."""

        def merged(mine: dict, theirs: dict) -> dict:
            return {path: {**by_size, **theirs.get(path, {})} for path, by_size in mine.items()}

        return Measured(
            merged(self.medians, again.medians),
            merged(self.spreads, again.spreads),
            merged(self.cpu_shares, again.cpu_shares),
            merged(self.variants, again.variants),
        )

    def _noise(self) -> list[tuple[int, str]]:
        found = []
        for path, by_size in sorted(self.medians.items()):
            sizes = sorted(by_size)
            for index, size in enumerate(sizes):
                median, spread = by_size[size], self.spreads.get(path, {}).get(size, 0.0)
                share = self.cpu_shares.get(path, {}).get(size, 1.0)
                if share < NOISE_CPU_SHARE:
                    found.append((size, (
                        f"{path} at {format_byte_size(size)}: the probe's ranks had {share:.0%} of a core each "
                        f"(median {median * 1e6:.1f} us)"
                    )))  # fmt: skip
                elif spread > NOISE_SPREAD:
                    found.append((size, (
                        f"{path} at {format_byte_size(size)}: its iterations' middle half spans {spread:.1f}x its "
                        f"median {median * 1e6:.1f} us"
                    )))  # fmt: skip
                elif index + 1 < len(sizes):
                    larger = sizes[index + 1]
                    ratio = median / by_size[larger] if by_size[larger] else float("inf")
                    if not 1 / NOISE_JUMP <= ratio <= NOISE_JUMP:
                        text = (
                            f"{path} at {format_byte_size(size)}: {median * 1e6:.1f} us, {ratio:.2g}x the "
                            f"{by_size[larger] * 1e6:.1f} us at {format_byte_size(larger)}"
                        )
                        found += [(size, text), (larger, text)]
        return found


async def probe(
    device_kind: str,
    socket: str,
    world_size: int,
    min_bytes: int,
    max_bytes: int,
    timeout: float,
    on_point: Callable[[str, int, float], None] = lambda path, size, seconds: None,
    sizes: list[int] | None = None,
    wires: list[str] = (),
) -> Measured:
    """Run the bench's rank programs against the daemon at `socket`; the slowest rank's median
    seconds and spread per path and size (min_bytes .. max_bytes in powers of two, or `sizes`),
    and per compressed wire in `wires` ("oneshot+int8" rows), each median also passed to on_point
    as it is measured. Raises InternalError with the probe's output when it fails."""
    if not has_rank_environment():
        raise UnsupportedError(
            "calibrating runs the bench's rank processes, which need torch, and this daemon's environment has "
            "none, or a nodecomm installed before it (a daemon-only install): run the daemon from an environment "
            "with torch, then nodecomm (the container image's with-torch target) to calibrate; live recalibration "
            "from the ranks' timings runs without it"
        )
    # The table comes back as the last line of the probe's output: no file or folder of its own
    # is left behind by a probe (or a daemon) that is killed.
    args = [
        # -X faulthandler: a probe that crashes prints every thread's stack into the error.
        sys.executable, "-X", "faulthandler", "-m", "nodecomm.tools.cli", "--socket", socket, "bench",
        *PROBE_FLAGS[device_kind], "--world-size", str(world_size), "--progress",
        *(["--wire", ",".join(wires)] if wires else []),
        *(["--sizes", ",".join(map(str, sizes))] if sizes else ["--min-bytes", str(min_bytes), "--max-bytes", str(max_bytes)]),
        "--json", "-",
    ]  # fmt: skip
    process = start_probe(args)
    loop = asyncio.get_running_loop()
    output: list[str] = []
    tables: list[dict] = []

    def follow() -> None:
        """On a worker thread: the probe's lines until its output ends, then its exit."""
        with process.stdout:
            for raw in process.stdout:
                line = raw.decode(errors="replace")
                try:
                    parsed = json.loads(line) if line.startswith("{") else None
                except ValueError:
                    parsed = None  # not JSON after all: kept as output
                if isinstance(parsed, dict) and isinstance(parsed.get("rows"), list):
                    tables.append(parsed)
                    continue
                try:
                    point = parsed["progress"] if isinstance(parsed, dict) else None
                    measured = (point["path"], point["size_bytes"], point["p50_us"] / 1e6) if point else None
                except (KeyError, TypeError):
                    measured = None
                if measured is None:
                    output.append(line)
                else:
                    loop.call_soon_threadsafe(on_point, *measured)
        process.wait()

    reading = asyncio.ensure_future(asyncio.to_thread(follow))
    try:
        await asyncio.wait_for(asyncio.shield(reading), timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError) as stopped:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await asyncio.shield(reading)  # the output ends with the probe's processes
        if isinstance(stopped, asyncio.CancelledError):
            raise
        raise InternalError(f"the calibration probe did not finish within {timeout:.0f} s") from None
    if process.returncode != 0 or not tables:
        tail = "".join(output)[-2000:]
        raise InternalError(f"the calibration probe failed (exit {process.returncode}): {tail}")
    return measured_from_rows(tables[-1].get("rows"), device_kind)


def measured_from_rows(rows: list[dict], device_kind: str) -> Measured:
    """What the probe measured, from the rows of the bench's JSON table (tools/bench.py's Row);
    InternalError where they are unreadable."""
    medians: dict[str, dict[int, float]] = {}
    spreads: dict[str, dict[int, float]] = {}
    shares: dict[str, dict[int, float]] = {}
    variants: dict[str, dict[int, str]] = {}
    try:
        for row in rows:
            if row.get("variant"):
                variants.setdefault(row["path"], {})[row["size_bytes"]] = row["variant"]
            if device_kind == DeviceKind.CPU:
                shares.setdefault(row["path"], {})[row["size_bytes"]] = row["cpu_share"]
            medians.setdefault(row["path"], {})[row["size_bytes"]] = row["p50_us"] / 1e6
            middle = row["p75_us"] - row["p25_us"]
            spreads.setdefault(row["path"], {})[row["size_bytes"]] = middle / row["p50_us"] if row["p50_us"] else 0.0
    except (ValueError, KeyError, TypeError, ZeroDivisionError, AttributeError) as error:
        raise InternalError(f"the calibration probe's results are unreadable: {error!r}") from None
    return Measured(medians, spreads, shares, variants)


def calibration_point(label: str, size: int, seconds: float) -> pb.CalibrationPoint:
    """A measured point of a row named "oneshot" or "oneshot+int8" (a path over a wire)."""
    path, _, wire = label.partition("+")
    return pb.CalibrationPoint(
        path=Path.parse(path).to_proto(),
        bytes=size,
        seconds=seconds,
        wire=pb.Wire.Value((wire or "lossless").upper()),
    )
