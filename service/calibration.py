"""Calibration: measure where each path stops winning on this machine, and remember it.

A probe runs the `nodecomm bench` rank programs against this daemon (a subprocess, so the daemon
never imports torch), times every constructed path over a size sweep, and places each boundary
where the next path wins by a margin over a tail of sizes. The result is stored in the state
directory under a fingerprint of the machine, so a restarted daemon reuses it without probing.
CPU groups calibrate `shm` oneshot against twoshot; CUDA groups oneshot, twoshot, dma and, where
every probe rank has a GPU of its own, NCCL, timed in CUDA graphs as engines run them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jsonschema

from nodecomm import _native, trust
from nodecomm.byte_size import format_byte_size
from nodecomm.capabilities import path_names
from nodecomm.errors import InternalError, NodecommError
from nodecomm.thresholds import Boundary, Source, build_table
from nodecomm.thresholds import Path as ThresholdPath
from nodecomm.v1 import control_pb2 as pb

log = logging.getLogger("nodecomm.calibration")

DEFAULT_MARGIN = 0.02
DEFAULT_TAIL = 2


def cpu_fingerprint() -> dict[str, object]:
    """What a CPU calibration depends on: the processor, how many of them, the native build."""
    model = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    except OSError:
        pass
    return {
        "device_kind": "cpu",
        "machine": platform.machine(),
        "cpu_model": model,
        "cpus": os.cpu_count(),
        "native": native_build(),
    }


def cuda_fingerprint(devices: list[dict], links: list[list[tuple]]) -> dict[str, object]:
    """What a CUDA calibration depends on: which GPUs (model, PCI address, UUID), how they reach
    each other, and the native build. `devices` and `links` as _native.cuda_devices() and
    _native.cuda_peer_links() give them."""
    return {
        "device_kind": "cuda",
        "gpus": [f"{d['name']} {d['pci_bus_id']} {d['uuid']}" for d in devices],
        "peer_links": [[list(cell) for cell in row] for row in links],
        "native": native_build(),
    }


@functools.cache
def native_build() -> str:
    """A digest of the native module's file: a rebuilt or upgraded transport is measured anew."""
    digest = hashlib.sha256()
    with open(_native.__file__, "rb") as module:
        for block in iter(lambda: module.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def fingerprint_key(fingerprint: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def small_path_max(
    sizes: list[int],
    small: dict[int, float],
    large: dict[int, float],
    margin: float = DEFAULT_MARGIN,
    tail: int = DEFAULT_TAIL,
) -> int | None:
    """The largest size the small-message path should carry: the size before the first one from
    which the large path is faster by more than `margin` at every size to the end of the sweep,
    a tail of at least `tail` sizes. None when the large path wins that way from the smallest size
    (the small path never wins); the largest size when it never does (no evidence beyond it)."""
    ordered = sorted(sizes)
    first = winning_tail(ordered, small, large, margin, tail)
    if first is None:
        return ordered[-1]
    return None if first == 0 else ordered[first - 1]


def winning_tail(
    ordered: list[int], base: dict[int, float], rival: dict[int, float], margin: float, tail: int
) -> int | None:
    """The index in `ordered` from which `rival` is faster than `base` by more than `margin` at
    every size to the end, where that run is at least `tail` sizes long; else None."""
    first = len(ordered)
    while first > 0 and rival[ordered[first - 1]] < base[ordered[first - 1]] * (1.0 - margin):
        first -= 1
    return first if len(ordered) - first >= tail else None


def compressed_min(
    sizes: list[int],
    lossless: dict[int, float],
    compressed: dict[int, float],
    margin: float = DEFAULT_MARGIN,
    tail: int = DEFAULT_TAIL,
) -> int | None:
    """The smallest size from which a compressed wire beats the lossless one (each on the path the
    table gives the size) by more than `margin` at every size to the end of the sweep, a tail of
    at least `tail` sizes; None when it never does (the wire stays off)."""
    ordered = sorted(sizes)
    first = winning_tail(ordered, lossless, compressed, margin, tail)
    return None if first is None else ordered[first]


def wire_boundaries(
    boundaries: dict[str, int | None], fallback: str, medians: dict[str, dict[int, float]], wires: list[str]
) -> dict[str, int | None]:
    """compressed_min_bytes per wire timed ("oneshot+int8" rows beside "oneshot"), comparing each
    size's compressed and lossless times on the path the calibrated `boundaries` give it (with
    `fallback` past them; an NCCL range never carries a compressed wire)."""
    table = build_table(
        {n: Boundary(n, v, Source.CALIBRATED) for n, v in boundaries.items()}, ThresholdPath(fallback), 0
    )
    measured = sorted(set().union(*(by_size.keys() for by_size in medians.values())))
    placed = {}
    for wire in wires:
        lossless, compressed = {}, {}
        for size in measured:
            path = table.path_for(size).value
            if size in medians.get(path, {}) and size in medians.get(f"{path}+{wire}", {}):
                lossless[size], compressed[size] = medians[path][size], medians[f"{path}+{wire}"][size]
        placed[wire] = compressed_min(list(lossless), lossless, compressed) if lossless else None
    return placed


def cuda_boundaries(
    medians: dict[str, dict[int, float]], fallback: str, margin: float = DEFAULT_MARGIN
) -> dict[str, int | None]:
    """A CUDA table's boundaries (oneshot_max, twoshot_max, dma_min) from the paths' medians, for
    groups whose fallback path is `fallback` ("nccl" or "twoshot"): of every assignment of the
    boundaries to measured sizes (or off), the one whose table loses least against the fastest
    path, summed over the sizes, counting only losses beyond `margin`. A loss is relative (time /
    fastest - 1), so a blip at one size (a payload just past a slot, say) cannot outweigh a path
    winning the sizes around it. Ties go to the later switch. Raises InternalError when a path it
    needs was not measured."""
    needed = ("oneshot", "twoshot", "dma", fallback)
    missing = sorted({p for p in needed if not medians.get(p)})
    if missing:
        raise InternalError(f"the probe measured no {', '.join(missing)}; cannot place CUDA boundaries")
    sizes = sorted(set.intersection(*(set(medians[p]) for p in needed)))
    fastest = {s: min(medians[p][s] for p in needed) for s in sizes}

    def loss(oneshot_max: int | None, twoshot_max: int | None, dma_min: int | None) -> float:
        """Summed relative loss of the table these boundaries build (the dispatcher's own rule)."""
        values = {"oneshot_max_bytes": oneshot_max, "twoshot_max_bytes": twoshot_max, "dma_min_bytes": dma_min}
        boundaries = {name: Boundary(name, value, Source.CALIBRATED) for name, value in values.items()}
        table = build_table(boundaries, ThresholdPath(fallback), 0)
        return sum(max(0.0, medians[table.path_for(size).value][size] / fastest[size] - 1.0 - margin) for size in sizes)

    index = {size: i for i, size in enumerate(sizes)}
    choices = [None, *sizes]
    best: tuple | None = None
    for oneshot_max in choices:
        for twoshot_max in choices:
            if twoshot_max is not None and oneshot_max is not None and twoshot_max <= oneshot_max:
                continue  # twoshot would carry nothing: the same table as twoshot off
            for dma_min in choices:
                below = [b for b in (oneshot_max, twoshot_max) if b is not None]
                if dma_min is not None and below and dma_min <= max(below):
                    continue
                later = (
                    index.get(oneshot_max, -1),
                    index.get(twoshot_max, -1),
                    len(sizes) if dma_min is None else index[dma_min],
                )
                key = (round(loss(oneshot_max, twoshot_max, dma_min), 9), tuple(-i for i in later))
                if best is None or key < best[0]:
                    best = (key, (oneshot_max, twoshot_max, dma_min))
    oneshot_max, twoshot_max, dma_min = best[1]
    return {"oneshot_max_bytes": oneshot_max, "twoshot_max_bytes": twoshot_max, "dma_min_bytes": dma_min}


_BOUNDARY = {"type": ["integer", "null"], "minimum": 0, "maximum": 1 << 62}
_BOUNDARIES = {
    "type": "object",
    "properties": {name: _BOUNDARY for name in ("oneshot_max_bytes", "twoshot_max_bytes", "dma_min_bytes")},
    "additionalProperties": False,
}
# What a stored calibration must hold before the daemon applies it (a file that parses but holds
# other types, ranges or shapes is ignored, naming the file and the field).
CALIBRATION_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["key", "fingerprint", "boundaries", "medians", "measured_at"],
    "properties": {
        "key": {"type": "string", "pattern": "^[0-9a-f]{16}$"},
        "fingerprint": {
            "type": "object",
            "required": ["device_kind"],
            "properties": {"device_kind": {"enum": ["cpu", "cuda"]}},
        },
        "boundaries": _BOUNDARIES,
        "nccl_boundaries": {"anyOf": [{"type": "null"}, _BOUNDARIES]},
        "wire_boundaries": {
            "type": "object",
            "propertyNames": {"enum": ["int8", "fp8"]},
            "additionalProperties": _BOUNDARY,
        },
        "medians": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "propertyNames": {"pattern": "^[0-9]+$"},
                "additionalProperties": {"type": "number", "minimum": 0},
            },
        },
        "measured_at": {"type": "number"},
        "forms": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "propertyNames": {"pattern": "^[0-9]+$"},
                "additionalProperties": {"enum": ["push", "pull"]},
            },
        },
    },
}
_VALIDATOR = jsonschema.Draft202012Validator(CALIBRATION_SCHEMA)


class InvalidCalibrationError(ValueError):
    """A stored calibration that is not what the daemon writes: the message names the field."""


@dataclass(frozen=True)
class Calibration:
    key: str
    fingerprint: dict[str, object]
    boundaries: dict[str, int | None]
    # Slowest rank's median seconds per path and size, as measured.
    medians: dict[str, dict[int, float]]
    measured_at: float
    # CUDA, where the probe timed NCCL: the boundaries for groups whose fallback is NCCL.
    nccl_boundaries: dict[str, int | None] | None = None
    # How a path moved each size where it has several forms: CUDA oneshot's "push" or "pull".
    forms: dict[str, dict[int, str]] = field(default_factory=dict)
    # compressed_min_bytes per compressed wire the probe timed (None: it never won).
    wire_boundaries: dict[str, int | None] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        """Parse and validate (CALIBRATION_SCHEMA); InvalidCalibrationError names what is wrong."""
        try:
            raw = json.loads(text)
        except ValueError as error:
            raise InvalidCalibrationError(f"not JSON: {error}") from None
        problem = jsonschema.exceptions.best_match(_VALIDATOR.iter_errors(raw))
        if problem is not None:
            where = "".join(f"[{part!r}]" if isinstance(part, int) else f".{part}" for part in problem.absolute_path)
            raise InvalidCalibrationError(f"{where.lstrip('.') or 'the file'}: {problem.message}")
        medians = {
            path: {int(size): seconds for size, seconds in by_size.items()} for path, by_size in raw["medians"].items()
        }

        def whole(boundaries: dict | None) -> dict[str, int | None] | None:  # 5.0 is an integer to JSON Schema
            return None if boundaries is None else {k: None if v is None else int(v) for k, v in boundaries.items()}

        forms = {
            path: {int(size): form for size, form in by_size.items()} for path, by_size in raw.get("forms", {}).items()
        }
        return cls(
            raw["key"], raw["fingerprint"], whole(raw["boundaries"]), medians, raw["measured_at"],
            whole(raw.get("nccl_boundaries")), forms, whole(raw.get("wire_boundaries", {})),
        )  # fmt: skip


class CalibrationStore:
    """Calibrations on disk, one JSON file per fingerprint: <state_dir>/calibration-<key>.json.
    A store that is not writable (the node's state, to a job's private daemon) reads them and saves
    nothing. A `private` one (a user's cache) is a directory of the user's alone, made 0700 on the
    first save and checked as the runtime directory is (nodecomm.trust) before every read or
    write: one that fails the checks is neither."""

    def __init__(self, state_dir: str, writable: bool = True, private: bool = False):
        self.directory = Path(state_dir)
        self.writable = writable
        self.private = private

    def _trusted(self, create: bool) -> bool:
        """For a private store: whether its directory is the user's alone (made so if `create`)."""
        if not create and not self.directory.exists():
            return False
        try:
            if create:
                os.makedirs(self.directory.parent, mode=0o700, exist_ok=True)
            trust.make_private_directory(str(self.directory))
        except (OSError, NodecommError) as error:
            log.warning(
                f"not using the calibration cache {self.directory}: {error}", extra={"path": str(self.directory)}
            )
            return False
        return True

    def path_for(self, key: str) -> Path:
        return self.directory / f"calibration-{key}.json"

    def load(self, fingerprint: dict[str, object]) -> Calibration | None:
        """The calibration stored for this fingerprint; None (logged, naming the file and what is
        wrong with it) where the file is unreadable, invalid, or another machine's."""
        key = fingerprint_key(fingerprint)
        path = self.path_for(key)
        if self.private and not self._trusted(create=False):
            return None
        try:
            calibration = Calibration.from_json(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            problem = str(error)
        else:
            differs = sorted(
                name for name in fingerprint.keys() | calibration.fingerprint.keys()
                if fingerprint.get(name) != calibration.fingerprint.get(name)
            )  # fmt: skip
            if calibration.key == key and not differs:
                return calibration
            problem = f"its fingerprint is not this machine's (it differs in {', '.join(differs) or 'key'})"
        log.warning(
            f"ignoring the calibration in {path}: {problem}; the built-in boundaries stay in force",
            extra={"path": str(path), "error": problem},
        )
        return None

    def save(self, calibration: Calibration) -> Path | None:
        """Write atomically: a crash leaves the old file or the new one, never half of one. None:
        this store writes nothing."""
        if not self.writable:
            return None
        if self.private:
            if not self._trusted(create=True):
                raise PermissionError(f"{self.directory} is not a directory of this user's alone (see the log)")
        else:
            self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path_for(calibration.key)
        with tempfile.NamedTemporaryFile("w", dir=self.directory, delete=False, suffix=".tmp") as handle:
            handle.write(calibration.to_json())
        os.replace(handle.name, path)
        return path


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
    "cpu": ["--device", "cpu", "--paths", ",".join(path_names("cpu")), "--no-baseline"],
    "cuda": ["--device", "cuda", "--paths", ",".join(path_names("cuda")), "--graph"],
}


# A point is noise when the middle half of its iterations spans more than its median (the
# interquartile range over the median), or when its median and the next larger size's of the
# same path differ by more than NOISE_JUMP times either way: doubling a size moves an
# all-reduce's latency by at most ~2.5x on every machine measured (bench-cpu.md, bench-gpu.md).
# Loaded 2-core machines went far past both (4 KiB twoshot 13 us against 282 us at 8 KiB; middle
# halves of 100x the median); quiet ones stayed below 0.5 and 2.5x.
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
    range, per path and size, and the form a path took where it has several (CUDA oneshot)."""

    medians: dict[str, dict[int, float]]
    spreads: dict[str, dict[int, float]]
    cpu_shares: dict[str, dict[int, float]] = field(default_factory=dict)  # CPU probes
    forms: dict[str, dict[int, str]] = field(default_factory=dict)

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
            merged(self.forms, again.forms),
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
    try:
        rows = tables[-1]["rows"]
        medians: dict[str, dict[int, float]] = {}
        spreads: dict[str, dict[int, float]] = {}
        shares: dict[str, dict[int, float]] = {}
        forms: dict[str, dict[int, str]] = {}
        for row in rows:
            if row.get("form"):
                forms.setdefault(row["path"], {})[row["size_bytes"]] = row["form"]
            if device_kind == "cpu":
                shares.setdefault(row["path"], {})[row["size_bytes"]] = row["cpu_share"]
            medians.setdefault(row["path"], {})[row["size_bytes"]] = row["p50_us"] / 1e6
            middle = row["p75_us"] - row["p25_us"]
            spreads.setdefault(row["path"], {})[row["size_bytes"]] = middle / row["p50_us"] if row["p50_us"] else 0.0
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as error:
        raise InternalError(f"the calibration probe's results are unreadable: {error!r}") from None
    return Measured(medians, spreads, shares, forms)


def calibration_point(label: str, size: int, seconds: float) -> pb.CalibrationPoint:
    """A measured point of a row named "oneshot" or "oneshot+int8" (a path over a wire)."""
    path, _, wire = label.partition("+")
    return pb.CalibrationPoint(
        path=ThresholdPath.parse(path).to_proto(),
        bytes=size,
        seconds=seconds,
        wire=pb.Wire.Value((wire or "lossless").upper()),
    )


def calibration_from(
    fingerprint: dict[str, object],
    medians: dict[str, dict[int, float]],
    forms: dict[str, dict[int, str]] | None = None,
    wires: list[str] = (),
) -> Calibration:
    """The boundaries the medians place, for the fingerprint's device kind, and compressed_min_bytes
    per compressed wire in `wires` (timed as "path+wire" rows); `forms` kept beside them."""
    calibration = _lossless_calibration(fingerprint, medians, forms)
    if not wires:
        return calibration
    placed = wire_boundaries(calibration.boundaries, "twoshot", medians, list(wires))
    return dataclasses.replace(calibration, wire_boundaries=placed)


def _lossless_calibration(
    fingerprint: dict[str, object], medians: dict[str, dict[int, float]], forms: dict[str, dict[int, str]] | None
) -> Calibration:
    key = fingerprint_key(fingerprint)
    if fingerprint["device_kind"] == "cuda":
        with_nccl = cuda_boundaries(medians, "nccl") if "nccl" in medians else None
        return Calibration(
            key, fingerprint, cuda_boundaries(medians, "twoshot"), medians, time.time(), with_nccl, forms or {}
        )
    sizes = sorted(medians["oneshot"])
    boundaries = {"oneshot_max_bytes": small_path_max(sizes, medians["oneshot"], medians["twoshot"])}
    return Calibration(key, fingerprint, boundaries, medians, time.time())
