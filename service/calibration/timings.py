"""What ranks report on their sessions: sampled timings (the latency histograms, and a group's live
recalibration) and operation counts, within bounds: a batch far past what a client sends is
dropped whole, and past its rank's rate the rest of a batch is, so that one rank's stream cannot
take the daemon's time from everyone else's calls. What ranks report is theirs to make up: the
latency series are labelled by the uid whose group reported them, so that one user's timings never
move another's series; the series of at most MAX_REPORTING_UIDS uids are kept, the least recent
one's removed to make room."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from nodecomm.service.access.callers import Caller
from nodecomm.service.access.rates import TokenBucket
from nodecomm.service.calibration.tables import TableKeeper
from nodecomm.service.config import DaemonConfig
from nodecomm.service.groups.state import GroupState
from nodecomm.service.metrics.families import DaemonMetrics, size_bucket
from nodecomm.thresholds import Path
from nodecomm.v1 import control_pb2 as pb

if TYPE_CHECKING:
    from nodecomm.service.groups.group import Group

# A bound far past the 32 timings a client batches: anything longer is not a client of ours.
MAX_TIMINGS_PER_BATCH = 256
# The captured sizes a rank reports (native/dispatch.h keeps as many): a longer list is ignored.
MAX_CAPTURED_SIZES = 256
# The most bytes a session message may be: twice the largest batch the daemon reads (that many
# timings and a count for every op, path and wire, each field at its largest), room for fields a
# newer client adds. A longer one is refused before it is parsed, and its session ends.
MAX_SESSION_MESSAGE_BYTES = (
    2
    * pb.SessionUp(
        timings=pb.TimingBatch(
            timings=[pb.Timing(path=max(pb.Path.values()), bytes=2**64 - 1, seconds=1.0, wire=max(pb.Wire.values()))]
            * MAX_TIMINGS_PER_BATCH,
            counts=[
                pb.OperationCount(
                    op=op, path=path, operations=2**64 - 1, bytes=2**64 - 1, wire=wire, wire_bytes=2**64 - 1
                )
                for op in pb.Op.values()
                for path in pb.Path.values()
                for wire in pb.Wire.values()
            ],
            captured=[pb.CapturedSize(bytes=2**64 - 1, path=max(pb.Path.values()))] * MAX_CAPTURED_SIZES,
        )
    ).ByteSize()
)
# Uids whose latency series the metrics keep at once.
MAX_REPORTING_UIDS = 32

_OP_NAMES = {v: pb.Op.Name(v).lower() for v in pb.Op.values() if v}


def uid_label(caller: Caller) -> str:
    """The `uid` label of a caller's series: its uid, or "tcp"."""
    return "tcp" if caller.uid is None else str(caller.uid)


class TimingIntake:
    """The daemon's use of what sessions report, over the metrics and the groups' tables."""

    def __init__(self, config: DaemonConfig, metrics: DaemonMetrics, tables: TableKeeper):
        self.config = config
        self.metrics = metrics
        self.tables = tables
        # (path, size bucket) each caller reported, the least recent caller first.
        self._series: OrderedDict[Caller, set[tuple[str, str]]] = OrderedDict()

    def _series_of(self, caller: Caller) -> set[tuple[str, str]]:
        series = self._series.get(caller)
        if series is None:
            if len(self._series) >= MAX_REPORTING_UIDS:
                self._forget(next(iter(self._series)))
            series = self._series[caller] = set()
        self._series.move_to_end(caller)
        return series

    def _forget(self, caller: Caller) -> None:
        uid, series = uid_label(caller), self._series.pop(caller, set())
        for path, bucket in series:
            self.metrics.op_seconds.remove("all_reduce", path, bucket, uid)
        for path in {path for path, _ in series}:
            self.metrics.sampled_ops.remove("all_reduce", path, uid)

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

    @staticmethod
    def record_captured(group: Group, captured: Sequence[pb.CapturedSize]) -> None:
        """A rank's sizes captured in CUDA graphs, and their paths, now the group's (its ranks
        capture alike; the newest report stands)."""
        if not captured or len(captured) > MAX_CAPTURED_SIZES:
            return
        group.captured = {c.bytes: Path.from_proto(c.path) for c in captured if c.path in pb.Path.values() and c.path}

    def record_timings(self, group: Group | None, rank: int, timings: Sequence[pb.Timing]) -> None:
        """Use `rank`'s timings (of `group`; none once it is released)."""
        if len(timings) > MAX_TIMINGS_PER_BATCH:
            self.metrics.timings_dropped.labels("batch").inc(len(timings))
            return
        member = group.members.get(rank) if group is not None else None
        if member is None:
            return
        if member.timing_budget is None:
            member.timing_budget = TokenBucket(self.config.timing_rate_per_rank)
        allowed = member.timing_budget.take(len(timings))
        if allowed < len(timings):
            self.metrics.timings_dropped.labels("rate").inc(len(timings) - allowed)
            timings = timings[:allowed]
        uid = uid_label(group.creator)
        series = self._series_of(group.creator)
        for timing in timings:
            if not 0 <= timing.seconds < 3600 or timing.path not in pb.Path.values() or not timing.path:
                continue
            path = Path.from_proto(timing.path)
            if timing.wire != pb.LOSSLESS:
                # The group's own compressed wire feeds its live estimates only (the latency
                # histograms are of lossless calls); any other wire is a call that forced one.
                if group.live is not None and timing.wire == group.args.wire:
                    group.live.add(rank, path, timing.bytes, timing.seconds, compressed=True)
                continue
            bucket = size_bucket(timing.bytes)
            series.add((path.value, bucket))
            self.metrics.sampled_ops.labels("all_reduce", path.value, uid).inc()
            self.metrics.op_seconds.labels("all_reduce", path.value, bucket, uid).observe(timing.seconds)
            if group.live is not None:
                group.live.add(rank, path, timing.bytes, timing.seconds)
        if group.live is not None and group.state == GroupState.ACTIVE:
            self._follow_evidence(group)

    def _follow_evidence(self, group: Group) -> None:
        """Move the group's boundary where its timings demand, and offer every rank the new table."""
        table = self.tables.follow_evidence(
            group.name, group.args.device_kind, group.table, group.live, group.args.nccl_fallback
        )
        if table is not None:
            group.table = table
            group.broadcast(pb.SessionDown(thresholds=table.to_proto()))
