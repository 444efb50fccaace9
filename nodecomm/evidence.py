"""Timings as evidence for a size-range table, the one machine behind every boundary that moves
with the machine: the daemon's live recalibration (service/calibration/live_thresholds.py, choices are
paths) and the ranks' forms across nodes (client/across_nodes_forms.py, choices are forms).

Sizes fall in buckets, powers of 4 from 1 KiB, as the metrics label them and native/dispatch.h
explores them. Per choice and bucket every rank keeps its last SAMPLES_KEPT timings; a choice's
estimate there is the slowest rank's median, known once every rank has min_samples of them (and,
for part of a bucket, of sizes in that part). A table moves only where one choice beats another
by a margin on such estimates, and drops the evidence it moved on (hysteresis: nothing moves back
before new timings say so).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

# The buckets' upper ends: 1 KiB, 4 KiB, ..., 256 MiB; a last bucket holds every larger size.
SIZE_BUCKETS = [1 << (10 + 2 * i) for i in range(10)]
SAMPLES_KEPT = 32

Choice = TypeVar("Choice", bound=Hashable)


@dataclass(frozen=True)
class LivePolicy:
    """How a table follows live timings, the same for the daemon's paths and the forms across
    nodes: every explore_period-th call (near a boundary) takes another choice and is timed; a
    choice beating the table's by more than `margin`, with min_samples timings of each on every
    rank that times, takes the bucket; every switch_period-th call the ranks take the newest table
    together."""

    margin: float = 0.05
    min_samples: int = 8
    explore_period: int = 8
    switch_period: int = 256


def beats(challenger: float, incumbent: float, margin: float) -> bool:
    """Whether a choice's estimate beats another's by more than `margin`, a fraction of the other's
    time: the one test every move on this evidence passes."""
    return challenger < incumbent * (1.0 - margin)


def bucket_index(nbytes: int) -> int:
    """The bucket of a size: 0 up to 1 KiB, then one per power of 4, len(SIZE_BUCKETS) past them."""
    for index, top in enumerate(SIZE_BUCKETS):
        if nbytes <= top:
            return index
    return len(SIZE_BUCKETS)


def bucket_range(index: int) -> tuple[int, int]:
    """Inclusive (low, high) byte sizes of a bucket."""
    low = 0 if index == 0 else SIZE_BUCKETS[index - 1] + 1
    high = SIZE_BUCKETS[index] if index < len(SIZE_BUCKETS) else 1 << 62
    return low, high


@dataclass
class Evidence(Generic[Choice]):
    """Recent timings per (choice, bucket) and rank, for `world_size` ranks."""

    world_size: int
    min_samples: int
    # (choice, bucket) -> rank -> recent (bytes, seconds)
    samples: dict[tuple[Choice, int], dict[int, deque[tuple[int, float]]]] = field(default_factory=dict)

    def add(self, rank: int, choice: Choice, nbytes: int, seconds: float) -> None:
        per_rank = self.samples.setdefault((choice, bucket_index(nbytes)), {})
        per_rank.setdefault(rank, deque(maxlen=SAMPLES_KEPT)).append((nbytes, seconds))

    def estimate(self, choice: Choice, bucket: int, cell: tuple[int, int] | None = None) -> float | None:
        """The slowest rank's median of its samples (of sizes within `cell`, inclusive, where given),
        once every rank has min_samples of them; else None."""
        per_rank = self.samples.get((choice, bucket), {})
        if len(per_rank) < self.world_size:
            return None
        medians = []
        for kept in per_rank.values():
            times = [seconds for nbytes, seconds in kept if cell is None or cell[0] <= nbytes <= cell[1]]
            if len(times) < self.min_samples:
                return None
            medians.append(statistics.median(times))
        return max(medians)

    def buckets(self) -> list[int]:
        """The buckets that hold any evidence, smallest first."""
        return sorted({bucket for _, bucket in self.samples})

    def forget(self, bucket_changed: Callable[[int], bool]) -> None:
        """Drop the evidence of every bucket `bucket_changed` names (its routing moved)."""
        for key in [key for key in self.samples if bucket_changed(key[1])]:
            del self.samples[key]
