"""Live recalibration: move a group's boundaries when its ranks' own timings show a neighbouring
path winning, with a margin and enough samples (hysteresis), so that the table follows the machine.

Ranks stream a sample of their operations' times (path, bytes, seconds; CUDA groups time them with
events). Per path and size bucket (powers of 4, as the metrics use) the estimate is the slowest
rank's median of its last samples, known once every rank has reported enough of them. Where the
path the table gives a bucket loses to the path of an adjacent range by more than the margin, the
boundaries between them move so that the winner takes the bucket, and the bucket's evidence is
dropped, so it has to build up again before anything moves back. The movable boundaries are
oneshot_max_bytes, twoshot_max_bytes and dma_min_bytes; overrides and the service path never move.
A path's samples come from the sizes the table sends it and from exploration, which only ever
tries lossless paths: NCCL is timed where it carries sizes, never explored into.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass, field

from nodecomm.thresholds import Boundary, DispatchTable, Path, Source, build_table

from .metrics import SIZE_BUCKETS

SAMPLES_KEPT = 32


@dataclass(frozen=True)
class BoundaryMove:
    """The boundary changes the evidence demands, and the evidence."""

    values: dict[str, int | None]  # boundary name -> new value (None: off)
    bucket: tuple[int, int]  # inclusive byte range
    winner: Path
    winner_seconds: float
    loser_seconds: float


@dataclass
class LiveEstimates:
    world_size: int
    margin: float
    min_samples: int
    # (path, bucket index) -> rank -> recent seconds
    samples: dict[tuple[Path, int], dict[int, deque[float]]] = field(default_factory=dict)

    def add(self, rank: int, path: Path, nbytes: int, seconds: float) -> None:
        key = (path, bucket_index(nbytes))
        per_rank = self.samples.setdefault(key, {})
        per_rank.setdefault(rank, deque(maxlen=SAMPLES_KEPT)).append(seconds)

    def estimate(self, path: Path, bucket: int) -> float | None:
        """The slowest rank's median, once every rank has min_samples; else None."""
        per_rank = self.samples.get((path, bucket), {})
        if len(per_rank) < self.world_size or any(len(s) < self.min_samples for s in per_rank.values()):
            return None
        return max(statistics.median(s) for s in per_rank.values())

    def proposed_move(
        self, table: DispatchTable, fallback: Path, fixed: frozenset[str] = frozenset()
    ) -> BoundaryMove | None:
        """The first change, bucket by bucket from the smallest, that the evidence demands of
        `table` (built with `fallback`) without touching the `fixed` boundaries, or None."""
        for bucket in sorted({b for _, b in self.samples}):
            low, high = bucket_range(bucket)
            index = bisect.bisect_left(table.range_max, low)
            if bisect.bisect_left(table.range_max, high) != index:
                continue  # a bucket a boundary splits: no clean comparison
            current = table.range_paths[index]
            mine = self.estimate(current, bucket)
            if mine is None:
                continue
            for neighbour in (index - 1, index + 1):
                if not 0 <= neighbour < len(table.range_paths):
                    continue
                other = table.range_paths[neighbour]
                theirs = self.estimate(other, bucket)
                if theirs is None or theirs >= mine * (1.0 - self.margin):
                    continue
                values = _edge_move(table, min(index, neighbour), other, fallback, low, high)
                if values is None or fixed.intersection(values):
                    continue
                if _routes_bucket(table, fallback, values, low, high) != other:
                    continue  # the boundaries cannot hand the winner this bucket alone
                for path in (current, other):
                    self.samples.pop((path, bucket), None)
                return BoundaryMove(values, (low, high), other, theirs, mine)
        return None


def _edge_move(
    table: DispatchTable, edge: int, winner: Path, fallback: Path, low: int, high: int
) -> dict[str, int | None] | None:
    """New boundary values that move the edge between ranges `edge` and `edge + 1` so that
    `winner` (the path of one of them) takes the bucket [low, high]; None where no movable
    boundary makes that edge. An upper winner's range starts at the bucket; a lower winner's
    range ends with it."""
    lower, upper = table.range_paths[edge], table.range_paths[edge + 1]
    upper_wins = winner == upper
    if upper is Path.DMA:
        values: dict[str, int | None] = {"dma_min_bytes": low if upper_wins else high + 1}
        if not upper_wins and lower in _MAX_BOUNDARY and lower != fallback:
            values[_MAX_BOUNDARY[lower]] = high  # the lower path must reach the bucket's top too
        return values
    if lower in _MAX_BOUNDARY and upper is not Path.SERVICE:
        return {_MAX_BOUNDARY[lower]: (low - 1 if low > 0 else None) if upper_wins else high}
    return None


def _routes_bucket(table: DispatchTable, fallback: Path, values: dict[str, int | None], low: int, high: int):
    """The one path a table with `values` sends all of [low, high] to, or None if it splits it."""
    boundaries = {b.name: b for b in table.boundaries}
    for name, value in values.items():
        boundaries[name] = Boundary(name, value, Source.CALIBRATED)
    moved = build_table(boundaries, fallback, table.epoch)
    if bisect.bisect_left(moved.range_max, low) != bisect.bisect_left(moved.range_max, high):
        return None
    return moved.path_for(low)


_MAX_BOUNDARY = {Path.ONESHOT: "oneshot_max_bytes", Path.TWOSHOT: "twoshot_max_bytes"}


def bucket_index(nbytes: int) -> int:
    for index, top in enumerate(SIZE_BUCKETS):
        if nbytes <= top:
            return index
    return len(SIZE_BUCKETS)


def bucket_range(index: int) -> tuple[int, int]:
    """Inclusive (low, high) byte sizes of a bucket."""
    low = 0 if index == 0 else SIZE_BUCKETS[index - 1] + 1
    high = SIZE_BUCKETS[index] if index < len(SIZE_BUCKETS) else 1 << 62
    return low, high
