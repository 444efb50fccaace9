"""Boundary placement: from the probe's medians per path and size, where each path stops winning,
by a margin over a tail of sizes, and the calibration that records them."""

from __future__ import annotations

import dataclasses
import time

from nodecomm.capabilities import DeviceKind
from nodecomm.errors import InternalError
from nodecomm.service.calibration.fingerprint import fingerprint_key
from nodecomm.service.calibration.stored import Calibration
from nodecomm.thresholds import Boundary, Path, Source, build_table

DEFAULT_MARGIN = 0.02
DEFAULT_TAIL = 2


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
    table = build_table({n: Boundary(n, v, Source.CALIBRATED) for n, v in boundaries.items()}, Path(fallback), 0)
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
        table = build_table(boundaries, Path(fallback), 0)
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


def calibration_from(
    fingerprint: dict[str, object],
    medians: dict[str, dict[int, float]],
    variants: dict[str, dict[int, str]] | None = None,
    wires: list[str] = (),
) -> Calibration:
    """The boundaries the medians place, for the fingerprint's device kind, and compressed_min_bytes
    per compressed wire in `wires` (timed as "path+wire" rows); `variants` kept beside them."""
    calibration = _lossless_calibration(fingerprint, medians, variants)
    if not wires:
        return calibration
    placed = wire_boundaries(calibration.boundaries, "twoshot", medians, list(wires))
    return dataclasses.replace(calibration, wire_boundaries=placed)


def _lossless_calibration(
    fingerprint: dict[str, object], medians: dict[str, dict[int, float]], variants: dict[str, dict[int, str]] | None
) -> Calibration:
    key = fingerprint_key(fingerprint)
    if fingerprint["device_kind"] == DeviceKind.CUDA:
        with_nccl = cuda_boundaries(medians, "nccl") if "nccl" in medians else None
        return Calibration(
            key, fingerprint, cuda_boundaries(medians, "twoshot"), medians, time.time(), with_nccl, variants or {}
        )
    sizes = sorted(medians["oneshot"])
    boundaries = {"oneshot_max_bytes": small_path_max(sizes, medians["oneshot"], medians["twoshot"])}
    return Calibration(key, fingerprint, boundaries, medians, time.time())
