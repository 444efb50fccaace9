"""The dispatch table: which path carries an all-reduce of a given size.

The daemon builds a table from its boundaries (override > calibrated > default) and pushes it to
every rank of a group; each rank installs it into native/dispatch.h, the one place that decides a
call's path (the client's Dispatcher does, nodecomm/client/dispatch.py). All ranks of a group
hold the same table at the same epoch, so they dispatch identically.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field

from nodecomm.byte_size import format_byte_size
from nodecomm.v1 import control_pb2 as pb


class ContractName(str, enum.Enum):
    """A name of one of nodecomm.v1's enums (the member's name is the proto value's), parsed from
    what a user writes in any case."""

    @classmethod
    def contract(cls):  # the proto enum, named as the class is
        return getattr(pb, cls.__name__)

    @classmethod
    def parse(cls, name: str):
        try:
            return cls(name.lower())
        except ValueError:
            known = ", ".join(member.value for member in cls)
            raise ValueError(f"unknown {cls.__name__.lower()} {name!r}: expected one of {known}") from None

    def to_proto(self) -> int:
        return self.contract().Value(self.name)

    @classmethod
    def from_proto(cls, value: int):
        return cls[cls.contract().Name(value)]


class Path(ContractName):
    ONESHOT = "oneshot"
    TWOSHOT = "twoshot"
    DMA = "dma"
    NCCL = "nccl"
    SERVICE = "service"


class Wire(ContractName):
    """What an all-reduce's payload crosses between ranks as: the elements themselves, or one of
    the compressed formats a call or a group must ask for (native/wire.h)."""

    LOSSLESS = "lossless"
    INT8 = "int8"
    FP8 = "fp8"

    def encoded_bytes(self, count: int, element_bytes: int) -> int:
        """Bytes `count` elements take on this wire: a byte each and a 4-byte scale per 32."""
        return count * element_bytes if self is Wire.LOSSLESS else count + 4 * -(-count // WIRE_BLOCK)


WIRE_BLOCK = 32  # elements per scale on a compressed wire
# The peer paths: the ranks run them among themselves over the group's memory. Each can carry a
# compressed wire (where the transport runs it).
PEER_PATHS = (Path.ONESHOT, Path.TWOSHOT, Path.DMA)
WIRE_PATHS = frozenset(PEER_PATHS)


class Source(str, enum.Enum):
    DEFAULT = "default"
    CALIBRATED = "calibrated"
    OVERRIDE = "override"


# The boundaries, in the order they are shown. A `*_max_bytes` boundary sends sizes up to and
# including it to its path; a `*_min_bytes` boundary sends sizes from it up to its path.
# compressed_min_bytes exists only in the tables of groups that asked for a compressed wire: from
# it on, the sizes a WIRE_PATHS path carries go compressed.
BOUNDARY_NAMES = (
    "oneshot_max_bytes",
    "twoshot_max_bytes",
    "dma_min_bytes",
    "service_min_bytes",
    "compressed_min_bytes",
)


@dataclass(frozen=True)
class Boundary:
    name: str
    value_bytes: int | None  # None: the path is off
    source: Source

    def describe(self) -> str:
        return f"{self.name}={format_byte_size(self.value_bytes)} ({self.source.value})"


def range_end(high: int) -> str:
    """Where a range that ends at `high` (inclusive) stops, as a round size: '<=32KiB', or '<6MiB'
    for a range ending one byte below one (the ranges below a *_min_bytes boundary)."""
    exact, next_up = format_byte_size(high), format_byte_size(high + 1)
    return f"<{next_up}" if exact.isdigit() and not next_up.isdigit() else f"<={exact}"


@dataclass(frozen=True)
class DispatchTable:
    """Ordered size ranges -> path and wire. `range_max[i]` is inclusive; the last range is
    unbounded. `wire`: the compressed wire the group asked for (LOSSLESS: none), which only its
    ranges from compressed_min_bytes on carry."""

    epoch: int
    range_max: tuple[int, ...]  # inclusive upper ends of all ranges but the last
    range_paths: tuple[Path, ...]  # one more than range_max
    boundaries: tuple[Boundary, ...] = field(default=())
    range_wires: tuple[Wire, ...] = field(default=())  # as range_paths; empty: every range lossless
    wire: Wire = Wire.LOSSLESS
    # Where the calibrated boundaries come from, for people: "built-in defaults", the calibration
    # file and when it was measured, or the live timings that moved them.
    origin: str = field(default="", compare=False)
    # Per size bucket (powers of 4 from 1 KiB to 256 MiB, then one for all larger sizes), a mask
    # (1 << the path's nodecomm.v1 value) of the paths live recalibration found slower there than
    # this table's by its margin: exploration leaves them alone (native/dispatch.h).
    settled: tuple[int, ...] = field(default=())

    def path_for(self, nbytes: int) -> Path:
        return self.range_paths[bisect.bisect_left(self.range_max, nbytes)]

    def wire_for(self, nbytes: int) -> Wire:
        if not self.range_wires:
            return Wire.LOSSLESS
        return self.range_wires[bisect.bisect_left(self.range_max, nbytes)]

    def wires(self) -> tuple[Wire, ...]:
        return self.range_wires or (Wire.LOSSLESS,) * len(self.range_paths)

    def boundary(self, name: str) -> Boundary:
        for b in self.boundaries:
            if b.name == name:
                return b
        raise KeyError(name)

    def paths(self) -> frozenset[Path]:
        return frozenset(self.range_paths)

    def rows(self) -> list[tuple[int, int | None, Path]]:
        """(first size, last size, path) per range, in bytes, both ends inclusive; the last range's
        end is None (unbounded). wires() gives each range's wire."""
        rows = []
        low = 0
        for high, path in zip((*self.range_max, None), self.range_paths, strict=True):
            rows.append((low, high, path))
            low = (high or 0) + 1
        return rows

    def labels(self) -> list[tuple[str, Path]]:
        """(sizes, path) per range for display, every end in one style: '<=32KiB', '>32KiB and
        <6MiB', '>=6MiB'; 'every size' for a table of one range."""
        ends = [range_end(high) for high in self.range_max]
        labels = []
        for index, path in enumerate(self.range_paths):
            parts = []
            if index > 0:  # where the range below stops, from this side
                below = ends[index - 1]
                parts.append(f">{below[2:]}" if below.startswith("<=") else f">={below[1:]}")
            if index < len(ends):
                parts.append(ends[index])
            labels.append((" and ".join(parts) or "every size", path))
        return labels

    def to_proto(self) -> pb.ThresholdTable:
        table = pb.ThresholdTable(
            epoch=self.epoch, wire=self.wire.to_proto(), origin=self.origin, settled=list(self.settled)
        )
        wires = self.wires()
        for high, path, wire in zip(self.range_max, self.range_paths[:-1], wires[:-1], strict=True):
            table.ranges.add(max_bytes=high, path=path.to_proto(), wire=wire.to_proto())
        table.ranges.add(unbounded=True, path=self.range_paths[-1].to_proto(), wire=wires[-1].to_proto())
        for b in self.boundaries:
            entry = table.boundaries.add(name=b.name, source=pb.BoundarySource.Value(b.source.name))
            if b.value_bytes is not None:
                entry.value_bytes = b.value_bytes
        return table

    @classmethod
    def from_proto(cls, table: pb.ThresholdTable) -> DispatchTable:
        ranges = list(table.ranges)
        if not ranges or not ranges[-1].unbounded or any(r.unbounded for r in ranges[:-1]):
            raise ValueError("a threshold table needs exactly one unbounded range, the last")
        bounded = ranges[:-1]
        boundaries = tuple(
            Boundary(
                b.name,
                b.value_bytes if b.HasField("value_bytes") else None,
                Source[pb.BoundarySource.Name(b.source)],
            )
            for b in table.boundaries
        )
        wires = tuple(Wire.from_proto(r.wire) for r in ranges)
        return cls(
            epoch=table.epoch,
            range_max=tuple(r.max_bytes for r in bounded),
            range_paths=tuple(Path.from_proto(r.path) for r in ranges),
            boundaries=boundaries,
            range_wires=wires if any(w is not Wire.LOSSLESS for w in wires) else (),
            wire=Wire.from_proto(table.wire),
            origin=table.origin,
            settled=tuple(table.settled),
        )


def build_table(
    boundaries: dict[str, Boundary], fallback: Path, epoch: int, wire: Wire = Wire.LOSSLESS
) -> DispatchTable:
    """Turn boundaries into ranges. `fallback` carries every size no boundary claims.

    The rule, in order: the service path from service_min_bytes; DMA from dma_min_bytes; oneshot
    up to oneshot_max_bytes; twoshot up to twoshot_max_bytes; otherwise the fallback (twoshot on
    CPU groups, NCCL on GPU groups). A group that asked for a compressed `wire` carries it from
    compressed_min_bytes on, on the paths that can; no other group has that boundary.
    """
    if wire is Wire.LOSSLESS:
        boundaries = {name: b for name, b in boundaries.items() if name != "compressed_min_bytes"}
    value = {name: b.value_bytes for name, b in boundaries.items()}
    compressed_min = value.get("compressed_min_bytes")

    def rule(nbytes: int) -> Path:
        service_min = value.get("service_min_bytes")
        if service_min is not None and nbytes >= service_min:
            return Path.SERVICE
        dma_min = value.get("dma_min_bytes")
        if dma_min is not None and nbytes >= dma_min:
            return Path.DMA
        oneshot_max = value.get("oneshot_max_bytes")
        if oneshot_max is not None and nbytes <= oneshot_max:
            return Path.ONESHOT
        twoshot_max = value.get("twoshot_max_bytes")
        if twoshot_max is not None and nbytes <= twoshot_max:
            return Path.TWOSHOT
        return fallback

    def wire_rule(nbytes: int, path: Path) -> Wire:
        compressed = compressed_min is not None and nbytes >= compressed_min and path in WIRE_PATHS
        return wire if compressed else Wire.LOSSLESS

    # The rule is constant between these points, so evaluating it at each range's top is exact.
    points = {value.get("oneshot_max_bytes"), value.get("twoshot_max_bytes")}
    for name in ("dma_min_bytes", "service_min_bytes", "compressed_min_bytes"):
        if value.get(name) is not None:
            points.add(value[name] - 1)
    points = sorted(p for p in points if p is not None and p >= 0)
    range_max: list[int] = []
    ranges: list[tuple[Path, Wire]] = []
    for point in points:
        path = rule(point)
        here = (path, wire_rule(point, path))
        if ranges and ranges[-1] == here:
            range_max[-1] = point
        else:
            range_max.append(point)
            ranges.append(here)
    tail_path = rule(1 << 62)
    tail = (tail_path, wire_rule(1 << 62, tail_path))
    if ranges and ranges[-1] == tail:
        range_max.pop()
        ranges.pop()
    ranges.append(tail)
    ordered = tuple(boundaries[n] for n in BOUNDARY_NAMES if n in boundaries)
    wires = tuple(w for _, w in ranges)
    compressed = any(w is not Wire.LOSSLESS for w in wires)
    return DispatchTable(
        epoch, tuple(range_max), tuple(p for p, _ in ranges), ordered, wires if compressed else (), wire
    )
