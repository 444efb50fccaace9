"""The daemon's Prometheus metrics: prefix nodecomm_, base units, label sets bounded by design
(paths, ops, size buckets, error kinds and outcome names are fixed lists; devices are the GPUs the
daemon sees; a group's name labels only its own operation counts, removed when the group is
released, so those series are bounded by the groups alive; a uid labels the latency its groups'
ranks report, for at most timings.MAX_REPORTING_UIDS uids)."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from nodecomm import _native
from nodecomm.byte_size import format_byte_size
from nodecomm.evidence import SIZE_BUCKETS
from nodecomm.service.groups.group import Group
from nodecomm.service.groups.joining import FormingGroup
from nodecomm.service.groups.state import GroupState
from nodecomm.thresholds import Path

# Size buckets for operation latency labels: powers of 4 from 1 KiB to 256 MiB, then "inf".


def size_bucket(nbytes: int) -> str:
    for top in SIZE_BUCKETS:
        if nbytes <= top:
            return format_byte_size(top)
    return "inf"


# The nodecomm_group_aborts_total label of each abort reason; any other is "other".
_ABORT_LABELS = {
    _native.AbortReason.PEER_LOST: "peer_lost",
    _native.AbortReason.PEER_LEFT: "peer_left",
    _native.AbortReason.SHUTDOWN: "shutdown",
    _native.AbortReason.STALLED: "stalled",
    _native.AbortReason.MISMATCH: "mismatch",
}


def abort_label(reason: int) -> str:
    return _ABORT_LABELS.get(reason, "other")


class CapturedSizes(Collector):
    """nodecomm_captured_sizes, read from the groups at each scrape: a captured graph keeps the
    path it was captured with while the table moves on, so a size whose path and table_path
    differ replays on a path the table no longer prefers (re-capture to move it)."""

    def __init__(self, captured_paths: Callable[[], Iterable[tuple[str, Path, Path]]]):
        self._captured_paths = captured_paths

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "nodecomm_captured_sizes",
            "All-reduce sizes a live group's ranks captured in CUDA graphs, by group, the path captured and the "
            "path the group's table gives that size now.",
            labels=["group", "path", "table_path"],
        )
        tally = Tally((group, path.value, now.value) for group, path, now in self._captured_paths())
        for labels, sizes in sorted(tally.items()):
            family.add_metric(list(labels), sizes)
        yield family


class DaemonMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.groups = Gauge("nodecomm_groups", "Groups known to the daemon, by state.", ["state"], registry=r)
        self.ranks = Gauge("nodecomm_ranks", "Ranks holding a live session.", registry=r)
        self.joins = Counter("nodecomm_joins_total", "Join requests by outcome.", ["result"], registry=r)
        self.aborts = Counter("nodecomm_group_aborts_total", "Groups aborted, by reason.", ["reason"], registry=r)
        self.captured_aborts = Counter(
            "nodecomm_captured_group_aborts_total",
            "Groups aborted while CUDA graphs held a rank's calls (their replays return without their result; "
            "each such rank ends its process or logs, by its captured_abort policy), by reason; not a peer that "
            "left (a rank's graphs replaying after that end it too, which the daemon does not see).",
            ["reason"],
            registry=r,
        )
        self.captured_aborted = Gauge(
            "nodecomm_captured_aborted_groups",
            "Aborted groups, by name, that CUDA graphs of ranks still holding them replay (until every rank has gone).",
            ["group"],
            registry=r,
        )
        self.reserved = Gauge(
            "nodecomm_reserved_bytes", "Bytes of buffers reserved, by memory kind.", ["kind"], registry=r
        )
        self.buffer_bytes = Gauge(
            "nodecomm_buffer_bytes",
            "Bytes of buffers reserved, by device (host or GPU UUID) and use (collectives, topk, service).",
            ["device", "use"],
            registry=r,
        )
        self.operations = Counter(
            "nodecomm_operations_total",
            "Collective calls the ranks made through the client, by group, op and path; reported about "
            "once a second per rank (CUDA-graph replays are not seen).",
            ["group", "op", "path"],
            registry=r,
        )
        self.operation_bytes = Counter(
            "nodecomm_operation_bytes_total",
            "Payload bytes the ranks passed to those calls, by group, op and path.",
            ["group", "op", "path"],
            registry=r,
        )
        self.wire_operations = Counter(
            "nodecomm_wire_operations_total",
            "All-reduce calls by group and the wire their payload crossed as (lossless, int8, fp8: "
            "compressed only in calls or groups that asked for it).",
            ["group", "wire"],
            registry=r,
        )
        self.wire_bytes = Counter(
            "nodecomm_wire_bytes_total",
            "Bytes those calls' payloads took on their wire (codes and scales where compressed).",
            ["group", "wire"],
            registry=r,
        )
        self.fallbacks = Counter(
            "nodecomm_fallbacks_total",
            "Groups moved off their paths, by reason (peer_memory_unusable: every size goes to NCCL).",
            ["reason"],
            registry=r,
        )
        self.errors = Counter(
            "nodecomm_errors_total",
            "Errors answered to callers, by kind (the nodecomm.errors class).",
            ["kind"],
            registry=r,
        )
        self.adoptions = Counter(
            "nodecomm_adopted_groups_total",
            "Groups an earlier daemon formed that this one took over when their ranks came back (service/groups/adoption.py).",
            registry=r,
        )
        self.calls_without_daemon = Counter(
            "nodecomm_calls_without_daemon_total",
            "All-reduces the ranks of adopted groups ran while no daemon served them (summed over ranks).",
            registry=r,
        )
        self.claims = Counter(
            "nodecomm_descriptor_claims_total", "Descriptor claims by outcome.", ["result"], registry=r
        )
        self.threshold = Gauge(
            "nodecomm_threshold_bytes",
            "Boundary in force for new groups of a device kind (absent when off).",
            ["device_kind", "boundary", "source"],
            registry=r,
        )
        self.peer_checks = Counter(
            "nodecomm_peer_checks_total",
            "CUDA groups' peer-memory check stages by result; after a failure the group runs on NCCL "
            "only (or fails to form without an NCCL group).",
            ["result"],
            registry=r,
        )
        self.threshold_changes = Counter(
            "nodecomm_threshold_changes_total",
            "Boundaries moved by live recalibration, by boundary.",
            ["boundary"],
            registry=r,
        )
        self.calibrations = Counter(
            "nodecomm_calibrations_total", "Calibration probes run, by result.", ["result"], registry=r
        )
        self.sampled_ops = Counter(
            "nodecomm_sampled_operations_total",
            "Operations timed by ranks and reported, by the uid whose group reported them.",
            ["op", "path", "uid"],
            registry=r,
        )
        self.op_seconds = Histogram(
            "nodecomm_operation_seconds",
            "Sampled operation latency as seen by a rank, by the uid whose group reported it (ranks time "
            "their own calls: one uid's reports never enter another's series).",
            ["op", "path", "size_bucket", "uid"],
            registry=r,
            buckets=(2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.5, 1.0),
        )
        self.service_ops = Counter(
            "nodecomm_service_collectives_total",
            "Collectives the daemon ran for the service path, by op and result.",
            ["op", "result"],
            registry=r,
        )
        self.service_bytes = Counter(
            "nodecomm_service_bytes_total",
            "Bytes each rank contributed to service-path collectives that ran, by op.",
            ["op"],
            registry=r,
        )
        self.rpc_seconds = Histogram(
            "nodecomm_rpc_seconds",
            "Control-plane RPC handling time (Join includes waiting for peers).",
            ["method"],
            registry=r,
        )
        self.rpc_errors = Counter(
            "nodecomm_rpc_errors_total", "RPCs answered with an error.", ["method", "code"], registry=r
        )
        self.timings_dropped = Counter(
            "nodecomm_timings_dropped_total",
            "Timings from ranks' sessions the daemon did not use: in a batch past its size bound, or past the "
            "rank's rate (timing_rate_per_rank).",
            ["reason"],
            registry=r,
        )
        self.connections = Gauge(
            "nodecomm_connections", "Client connections open to the control socket and TCP listener.", registry=r
        )
        self.connections_refused = Counter(
            "nodecomm_connections_refused_total",
            "Connections closed as they arrived, by reason: not_admitted (allowed_uids/gids), per_caller "
            "(max_connections_per_caller), total (max_connections).",
            ["reason"],
            registry=r,
        )
        for reason in ("not_admitted", "per_caller", "total"):
            self.connections_refused.labels(reason)
        for reason in ("batch", "rate"):
            self.timings_dropped.labels(reason)
        for state in GroupState:
            self.groups.labels(state)
        self.reserved.labels("host")
        self.reserved.labels("cuda")
        for result in ("ok", "failed"):
            self.peer_checks.labels(result)
            self.calibrations.labels(result)
        self.calibrations.labels("noisy")  # noise through every measurement again: nothing stored or used
        self.fallbacks.labels("peer_memory_unusable")

    def reserve(self, kind: str, device: str, use: str, nbytes: int) -> None:
        """Account nbytes (negative: released) of `kind` memory ("host" or "cuda") on `device`
        ("host" or a GPU UUID) for `use`."""
        self.reserved.labels(kind).inc(nbytes)
        self.buffer_bytes.labels(device, use).inc(nbytes)

    def forget_group(
        self,
        name: str,
        held: Iterable[tuple[str, str, str, int]],
        counted: Iterable[tuple[str, str]],
        wires: Iterable[str],
    ) -> None:
        """A released group: what it `held` (kind, device, use, bytes) no longer reserved, and the
        series its name labels (its operation counts by (op, path) and by wire) gone."""
        for kind, device, use, nbytes in held:
            self.reserve(kind, device, use, -nbytes)
        for op, path in counted:
            self.operations.remove(name, op, path)
            self.operation_bytes.remove(name, op, path)
        for wire in wires:
            self.wire_operations.remove(name, wire)
            self.wire_bytes.remove(name, wire)

    def count_groups(self, forming: Iterable[FormingGroup], groups: Iterable[Group]) -> None:
        """The gauges of the daemon's groups: by state, the captured ones aborted, the ranks in session."""
        groups = list(groups)
        self.groups.labels(GroupState.JOINING).set(sum(1 for f in forming if f.arrivals))
        self.groups.labels(GroupState.ACTIVE).set(sum(1 for g in groups if g.state == GroupState.ACTIVE))
        self.groups.labels(GroupState.ABORTED).set(sum(1 for g in groups if g.state == GroupState.ABORTED))
        self.captured_aborted.clear()
        for group in groups:
            if group.state == GroupState.ABORTED and group.captured_ranks:
                self.captured_aborted.labels(group.name).inc()
        self.ranks.set(sum(1 for g in groups for m in g.members.values() if m.session is not None and not m.gone))
