"""Live recalibration: move a group's boundary when its ranks' own timings show the other path
winning, with a margin and enough samples (hysteresis), so that the table follows the machine.

Ranks stream a sample of their operations' times (path, bytes, seconds). Per path and size bucket
(powers of 4, as the metrics use) the estimate is the slowest rank's median of its last samples,
known once every rank has reported enough of them. Where the path the table gives a bucket loses
to the other lossless path by more than the margin, the boundary moves to the edge of that bucket
and the bucket's evidence is dropped, so it has to build up again before anything moves back.
CPU groups have one movable boundary, oneshot_max_bytes, between oneshot and twoshot.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from nodecomm.thresholds import DispatchTable, Path

from .metrics import SIZE_BUCKETS

SAMPLES_KEPT = 32


@dataclass(frozen=True)
class BoundaryMove:
    """A boundary change the evidence demands, and the evidence."""

    name: str
    value_bytes: int | None
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

    def proposed_move(self, table: DispatchTable) -> BoundaryMove | None:
        """The oneshot_max_bytes change the evidence demands, one bucket at a time, or None."""
        for bucket in sorted({b for _, b in self.samples}):
            low, high = bucket_range(bucket)
            current = table.path_for(high)
            if table.path_for(low) != current or current not in (Path.ONESHOT, Path.TWOSHOT):
                continue  # a bucket the boundary splits, or another path's: no clean comparison
            other = Path.TWOSHOT if current is Path.ONESHOT else Path.ONESHOT
            mine, theirs = self.estimate(current, bucket), self.estimate(other, bucket)
            if mine is None or theirs is None or theirs >= mine * (1.0 - self.margin):
                continue
            for path in (current, other):
                self.samples.pop((path, bucket), None)
            # oneshot wins the bucket: it takes the bucket; twoshot wins: oneshot stops below it.
            value = high if other is Path.ONESHOT else (low - 1 if low > 0 else None)
            return BoundaryMove("oneshot_max_bytes", value, (low, high), other, theirs, mine)
        return None


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
