"""Live recalibration: move a group's boundaries when its ranks' own timings show another path
winning, with a margin and enough samples (hysteresis), so that the table follows the machine.

Ranks stream a sample of their operations' times (path, bytes, seconds; CUDA groups time them with
events), and explore: now and then a call runs on another lossless path (native/dispatch.h).
Evidence is kept per path and size bucket (powers of 4, as the metrics use) and compared per cell:
the part of a bucket on one side of every boundary (a bucket the table splits, such as 4-16 MiB
around a 6 MiB dma_min_bytes, is two cells). A cell's estimate for a path is the slowest rank's
median of its last samples of sizes in the cell, known once every rank has reported enough of
them. Where another path beats the table's in a cell by more than the margin, the boundaries
move so that the fastest such path takes the cell, changing as few of them as will do it, unless
that sends a part of another bucket to a path its own evidence shows slower there than the one it
has: boundaries describe paths that take turns as sizes grow, and a machine where they do not is
left on the best table they can describe rather than moved back and forth. The evidence of every
bucket whose routing changed is dropped, so it has to build up again before anything moves back.
The movable boundaries are oneshot_max_bytes, twoshot_max_bytes and dma_min_bytes; overrides and
the service path never move. NCCL, the fallback of GPU groups that have it, is timed where it
carries sizes (or a call forces it), never explored into: so a move gives NCCL no size it did not
win, which nothing could move back.

A group that asked for a compressed wire also times it (its compressed ranges, and exploration
across compressed_min_bytes): where a bucket's path is faster on the other wire by the margin,
compressed_min_bytes moves so that the bucket takes that wire.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from nodecomm.evidence import SIZE_BUCKETS, Evidence, beats, bucket_range
from nodecomm.thresholds import PEER_PATHS, WIRE_PATHS, Boundary, DispatchTable, Path, Source, Wire, build_table


@dataclass(frozen=True)
class BoundaryMove:
    """The boundary changes the evidence demands, and the evidence."""

    values: dict[str, int | None]  # the boundaries that change -> new value (None: off)
    table: DispatchTable  # the table they build (at the old table's epoch)
    bucket: tuple[int, int]  # inclusive byte range
    winner: Path
    winner_seconds: float
    loser_seconds: float
    winner_wire: Wire = Wire.LOSSLESS


class LiveEstimates:
    """A group's evidence (nodecomm.evidence) per path, on the lossless wire and on the group's own,
    and the moves it demands of the group's table."""

    def __init__(self, world_size: int, margin: float, min_samples: int) -> None:
        self.margin = margin
        self.lossless: Evidence[Path] = Evidence(world_size, min_samples)
        self.compressed: Evidence[Path] = Evidence(world_size, min_samples)

    def add(self, rank: int, path: Path, nbytes: int, seconds: float, compressed: bool = False) -> None:
        (self.compressed if compressed else self.lossless).add(rank, path, nbytes, seconds)

    def estimate(
        self, path: Path, bucket: int, compressed: bool = False, cell: tuple[int, int] | None = None
    ) -> float | None:
        """Evidence.estimate on the lossless wire, or on the group's compressed one."""
        return (self.compressed if compressed else self.lossless).estimate(path, bucket, cell)

    def proposed_move(
        self, table: DispatchTable, fallback: Path, fixed: frozenset[str] = frozenset()
    ) -> BoundaryMove | None:
        """The first change, bucket by bucket from the smallest, that the evidence demands of
        `table` (built with `fallback`) without touching the `fixed` boundaries, or None. A move
        drops the evidence of every bucket whose path it changed, so that nothing moves back
        before new timings say so."""
        for bucket in self.lossless.buckets():
            for low, high, index in _cells(table, *bucket_range(bucket)):
                current = table.range_paths[index]
                mine = self.estimate(current, bucket, cell=(low, high))
                if mine is None:
                    continue
                rivals = []
                for path in (*PEER_PATHS, fallback):
                    theirs = None if path in (current, Path.SERVICE) else self.estimate(path, bucket, cell=(low, high))
                    if theirs is not None and beats(theirs, mine, self.margin):
                        rivals.append((theirs, path))
                for theirs, winner in sorted(rivals):  # the fastest first
                    for values, moved in _moves(table, winner, fallback, fixed, low, high):
                        if winner is not Path.NCCL and _hands_nccl(table, moved):
                            continue
                        if not self._slows(table, moved):
                            self._forget_changed(table, moved)
                            return BoundaryMove(values, moved, (low, high), winner, theirs, mine)
        return None

    def proposed_wire_move(
        self, table: DispatchTable, fallback: Path, fixed: frozenset[str] = frozenset()
    ) -> BoundaryMove | None:
        """For a group that asked for a compressed wire: the first change of compressed_min_bytes,
        bucket by bucket from the smallest, that the evidence demands of `table` (built with
        `fallback`): a bucket faster on the other wire by the margin takes it, unless the boundary
        is `fixed`. The bucket's evidence is dropped with the move. None where nothing moves."""
        if table.wire is Wire.LOSSLESS or "compressed_min_bytes" in fixed:
            return None
        for bucket in self.compressed.buckets():
            low, high = bucket_range(bucket)
            index = _range_of(table, low, high)
            path = table.range_paths[index] if index is not None else None
            if path not in WIRE_PATHS:
                continue  # split by a boundary, or a path that carries no compressed wire
            lossless, compressed = self.estimate(path, bucket), self.estimate(path, bucket, compressed=True)
            if lossless is None or compressed is None:
                continue
            on_wire = table.wire_for(low) is not Wire.LOSSLESS
            if not on_wire and beats(compressed, lossless, self.margin):
                value, winner, seconds, loser = low, table.wire, compressed, lossless
            elif on_wire and beats(lossless, compressed, self.margin):
                value, winner, seconds, loser = high + 1, Wire.LOSSLESS, lossless, compressed
            else:
                continue
            boundaries = {b.name: b for b in table.boundaries}
            boundaries["compressed_min_bytes"] = Boundary("compressed_min_bytes", value, Source.CALIBRATED)
            moved = build_table(boundaries, fallback, table.epoch, table.wire)
            if moved.wire_for(low) is not winner or moved.wire_for(high) is not winner:
                continue
            for evidence in (self.lossless, self.compressed):
                evidence.forget(lambda b, bucket=bucket: b == bucket)
            return BoundaryMove({"compressed_min_bytes": value}, moved, (low, high), path, seconds, loser, winner)
        return None

    def settled(self, old: DispatchTable, new: DispatchTable) -> tuple[int, ...]:
        """For `new` (the same table as `old`, or one a move made of it): per size bucket, the mask
        (1 << the path's nodecomm.v1 value) of the lossless paths that every cell of the bucket timed
        slower than the table's own path there by more than the margin, together with what `old`
        settled in the buckets `new` routes as it did; exploration need not time them again
        (native/dispatch.h). Trailing empty buckets are left out."""
        masks = [0] * (len(SIZE_BUCKETS) + 1)
        for bucket, mask in enumerate(old.settled):
            if _route(old, *bucket_range(bucket)) == _route(new, *bucket_range(bucket)):
                masks[bucket] = mask
        for bucket in self.lossless.buckets():
            for path in PEER_PATHS:
                verdicts = []
                for low, high, index in _cells(new, *bucket_range(bucket)):
                    mine = self.estimate(new.range_paths[index], bucket, cell=(low, high))
                    if new.range_paths[index] is path or mine is None:
                        continue
                    theirs = self.estimate(path, bucket, cell=(low, high))
                    verdicts.append(theirs is not None and theirs > mine * (1.0 + self.margin))
                if verdicts and all(verdicts):
                    masks[bucket] |= 1 << path.to_proto()
        while masks and not masks[-1]:
            masks.pop()
        return tuple(masks)

    def _forget_changed(self, old: DispatchTable, new: DispatchTable) -> None:
        self.lossless.forget(lambda bucket: _route(old, *bucket_range(bucket)) != _route(new, *bucket_range(bucket)))

    def _slows(self, old: DispatchTable, new: DispatchTable) -> bool:
        """Whether `new` sends a part of a bucket to a path that the evidence there shows slower,
        by more than the margin, than the path `old` gives it."""
        for bucket in self.lossless.buckets():
            for low, high, index in _cells(old, *bucket_range(bucket)):
                was = old.range_paths[index]
                for part_low, part_high, path in _route(new, low, high):
                    if path is was:
                        continue
                    before = self.estimate(was, bucket, cell=(part_low, part_high))
                    after = self.estimate(path, bucket, cell=(part_low, part_high))
                    if before is not None and after is not None and after > before * (1.0 + self.margin):
                        return True
        return False


def _cells(table: DispatchTable, low: int, high: int) -> list[tuple[int, int, int]]:
    """[low, high] cut at the table's range edges: (low, high, range index) of each part."""
    cells = []
    index = bisect.bisect_left(table.range_max, low)
    while index < len(table.range_max) and table.range_max[index] < high:
        cells.append((low, table.range_max[index], index))
        low, index = table.range_max[index] + 1, index + 1
    cells.append((low, high, index))
    return cells


def _route(table: DispatchTable, low: int, high: int) -> list[tuple[int, int, Path]]:
    """Which path the table gives each part of [low, high]."""
    return [(lo, hi, table.range_paths[index]) for lo, hi, index in _cells(table, low, high)]


def _hands_nccl(old: DispatchTable, new: DispatchTable) -> bool:
    """Whether `new` sends NCCL a size `old` gave another path. NCCL is never explored, and a
    move drops the evidence of the buckets it reroutes, so a size NCCL took without winning it
    could never come back: only NCCL's own win moves sizes to it."""
    everything = (0, bucket_range(len(SIZE_BUCKETS))[1])
    return any(
        path is Path.NCCL and any(was is not Path.NCCL for _, _, was in _route(old, low, high))
        for low, high, path in _route(new, *everything)
    )


def _range_of(table: DispatchTable, low: int, high: int) -> int | None:
    """The index of the one range holding all of [low, high], or None if a boundary splits it."""
    index = bisect.bisect_left(table.range_max, low)
    return index if bisect.bisect_left(table.range_max, high) == index else None


def _moves(
    table: DispatchTable, winner: Path, fallback: Path, fixed: frozenset[str], low: int, high: int
) -> list[tuple[dict[str, int | None], DispatchTable]]:
    """Every change of the movable boundaries not in `fixed` after which `winner` takes all of
    [low, high], as (the boundaries that change -> new value, the table they build), the fewest
    changes first, then the fewest buckets rerouted. Each boundary either stays, or has its edge
    at the cell: a path's range ends with the cell's top or just below its bottom, DMA's starts at
    either; or, where oneshot or twoshot wins, its boundary where the other's range ends now: it
    may take over its neighbour's whole range."""
    current = {b.name: b for b in table.boundaries}
    top = high >= bucket_range(len(SIZE_BUCKETS))[1]  # the unbounded end: nothing lies above it
    below = low - 1 if low > 0 else None
    edges = {
        "oneshot_max_bytes": (high, below),
        "twoshot_max_bytes": (high, below),
        "dma_min_bytes": (low, None if top else high + 1),
    }
    neighbour = {
        Path.ONESHOT: ("oneshot_max_bytes", "twoshot_max_bytes"),
        Path.TWOSHOT: ("twoshot_max_bytes", "oneshot_max_bytes"),
    }
    if winner in neighbour:
        own, other = neighbour[winner]
        if own in current and other in current and current[other].value_bytes is not None:
            edges[own] = tuple(dict.fromkeys((*edges[own], current[other].value_bytes)))
    choices = [
        [(name, value) for value in values if value != current[name].value_bytes]
        for name, values in edges.items()
        if name in current and name not in fixed
    ]
    found = []
    for picked in itertools.product(*[[None, *options] for options in choices]):
        values = dict(choice for choice in picked if choice is not None)
        if not values:
            continue
        boundaries = dict(current)
        for name, value in values.items():
            boundaries[name] = Boundary(name, value, Source.CALIBRATED)
        moved = build_table(boundaries, fallback, table.epoch, table.wire)
        index = _range_of(moved, low, high)
        if index is None or moved.range_paths[index] != winner:
            continue
        rerouted = sum(
            _route(table, *bucket_range(b)) != _route(moved, *bucket_range(b)) for b in range(len(SIZE_BUCKETS) + 1)
        )
        found.append((len(values), rerouted, values, moved))
    found.sort(key=lambda entry: entry[:2])
    return [(values, moved) for _, _, values, moved in found]
