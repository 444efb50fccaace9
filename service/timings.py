"""What ranks report on their sessions: sampled timings (the latency histograms, and a group's live
recalibration) and operation counts, within bounds: a batch far past what a client sends is
dropped whole, and past its rank's rate the rest of a batch is, so that one rank's stream cannot
take the daemon's time from everyone else's calls."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from nodecomm.thresholds import Path
from nodecomm.v1 import control_pb2 as pb

from .config import DaemonConfig
from .metrics import DaemonMetrics, size_bucket
from .tables import TableKeeper

if TYPE_CHECKING:
    from .group import Group

# A bound far past the 32 timings a client batches: anything longer is not a client of ours.
MAX_TIMINGS_PER_BATCH = 256

_OP_NAMES = {v: pb.Op.Name(v).lower() for v in pb.Op.values() if v}


class TokenBucket:
    """`rate` tokens a second on average, as many at once."""

    def __init__(self, rate: float):
        self.rate = rate
        self._tokens = rate
        self._at = time.monotonic()

    def take(self, wanted: int) -> int:
        """Up to `wanted` tokens, as many as there are."""
        now = time.monotonic()
        self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
        self._at = now
        granted = min(wanted, int(self._tokens))
        self._tokens -= granted
        return granted


class TimingIntake:
    """The daemon's use of what sessions report, over the metrics and the groups' tables."""

    def __init__(self, config: DaemonConfig, metrics: DaemonMetrics, tables: TableKeeper):
        self.config = config
        self.metrics = metrics
        self.tables = tables

    def record_counts(self, group: Group, counts: Sequence[pb.OperationCount]) -> None:
        for count in counts:
            if count.op not in _OP_NAMES or count.path not in pb.Path.values() or not count.path:
                continue
            labels = (_OP_NAMES[count.op], Path.from_proto(count.path).value)
            group.counted.add(labels)
            self.metrics.operations.labels(group.name, *labels).inc(count.operations)
            self.metrics.operation_bytes.labels(group.name, *labels).inc(count.bytes)
            if count.op == pb.ALL_REDUCE and count.wire in pb.Wire.values():
                wire = pb.Wire.Name(count.wire).lower()
                group.wires.add(wire)
                self.metrics.wire_operations.labels(group.name, wire).inc(count.operations)
                self.metrics.wire_bytes.labels(group.name, wire).inc(count.wire_bytes or count.bytes)

    def record_timings(self, group: Group | None, rank: int, timings: Sequence[pb.Timing]) -> None:
        """Use `rank`'s timings (of `group`, None once it is released: the metrics still take them)."""
        if len(timings) > MAX_TIMINGS_PER_BATCH:
            self.metrics.timings_dropped.labels("batch").inc(len(timings))
            return
        member = group.members.get(rank) if group is not None else None
        if member is not None:
            if member.timing_budget is None:
                member.timing_budget = TokenBucket(self.config.timing_rate_per_rank)
            allowed = member.timing_budget.take(len(timings))
            if allowed < len(timings):
                self.metrics.timings_dropped.labels("rate").inc(len(timings) - allowed)
                timings = timings[:allowed]
        for timing in timings:
            if not 0 <= timing.seconds < 3600 or timing.path not in pb.Path.values() or not timing.path:
                continue
            path = Path.from_proto(timing.path)
            if timing.wire != pb.LOSSLESS:
                # The group's own compressed wire feeds its live estimates only (the latency
                # histograms are of lossless calls); any other wire is a call that forced one.
                if group is not None and group.live is not None and timing.wire == group.args.wire:
                    group.live.add(rank, path, timing.bytes, timing.seconds, compressed=True)
                continue
            self.metrics.sampled_ops.labels("all_reduce", path.value).inc()
            self.metrics.op_seconds.labels("all_reduce", path.value, size_bucket(timing.bytes)).observe(timing.seconds)
            if group is not None and group.live is not None:
                group.live.add(rank, path, timing.bytes, timing.seconds)
        if group is not None and group.live is not None and group.state == "active":
            self._follow_evidence(group)

    def _follow_evidence(self, group: Group) -> None:
        """Move the group's boundary where its timings demand, and offer every rank the new table."""
        table = self.tables.follow_evidence(group.name, group.table, group.live, group.args.nccl_fallback)
        if table is not None:
            group.table = table
            group.broadcast(pb.SessionDown(thresholds=table.to_proto()))
