"""A CUDA group's peer-memory check: every rank reports each stage (the probe of every peer's
buffer, then a numeric self-test), and one verdict answers them all. A failed check takes the
peer paths away: every size goes to NCCL, or, without an NCCL group, the group cannot run."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from nodecomm.capabilities import DeviceKind
from nodecomm.errors import DeadlineExceededError, InvalidArgumentError, UnsupportedError
from nodecomm.service.calibration.tables import TableKeeper
from nodecomm.service.groups.rendezvous import OnStop, Rendezvous
from nodecomm.service.metrics.families import DaemonMetrics
from nodecomm.v1 import control_pb2 as pb

if TYPE_CHECKING:
    from nodecomm.service.groups.group import Group

log = logging.getLogger("nodecomm.groups")

STAGES = {1: "peer memory probe", 2: "numeric self-test"}


class PeerChecks:
    def __init__(self, metrics: DaemonMetrics, tables: TableKeeper):
        self.metrics = metrics
        self.tables = tables

    async def check(self, group: Group, report: pb.PeerCheckReport, timeout: float) -> pb.PeerCheckVerdict:
        """Collect one stage's reports from every rank; answer all of them with one verdict. A
        failed check takes the peer paths away: every size goes to NCCL, or, without an NCCL
        group, the group cannot run and every rank gets UnsupportedError."""
        where = dict(group=report.group or None, rank=report.rank)
        if group.args.device_kind != DeviceKind.CUDA:
            raise InvalidArgumentError("peer checks apply to CUDA groups", **where)
        if report.stage not in STAGES:
            raise InvalidArgumentError(f"stage {report.stage}: expected one of {sorted(STAGES)}", **where)
        check = group.peer_checks.setdefault(report.stage, Rendezvous(group.args.world_size))
        duplicate = f"rank {report.rank} already reported stage {report.stage}"
        check.arrive(report.rank, (report.ok, report.detail[:500]), duplicate, where)
        if check.complete:
            try:
                verdict = self._verdict(group, report.stage, check.arrivals)
            except UnsupportedError as error:
                check.fail(error)
            else:
                check.succeed(dict.fromkeys(check.arrivals, verdict))
        # A rank that stops waiting leaves its report: the verdict still comes once the others report.
        return await check.wait(
            report.rank,
            timeout,
            OnStop.STAND,
            timed_out=lambda missing: DeadlineExceededError(
                f"ranks {missing} did not report the {STAGES[report.stage]} within {timeout:.1f} s", **where
            ),
        )

    def _verdict(self, group: Group, stage: int, reports: dict[int, tuple[bool, str]]) -> pb.PeerCheckVerdict:
        """Every rank's verdict; UnsupportedError where a failed check leaves the group no path."""
        failures = [(rank, detail) for rank, (ok, detail) in sorted(reports.items()) if not ok]
        self.metrics.peer_checks.labels("failed" if failures else "ok").inc()
        if not failures:
            return pb.PeerCheckVerdict(peer_memory_ok=True, thresholds=group.table.to_proto())
        reason = f"{STAGES[stage]} failed: " + "; ".join(f"rank {r}: {d}" for r, d in failures)
        log.warning("peer memory unusable", extra={"group": group.name, "group_id": group.group_id, "reason": reason})
        if not group.args.nccl_fallback:
            raise UnsupportedError(f"{reason}; the ranks passed no NCCL group to fall back to", group=group.name)
        group.table = self.tables.nccl_only()
        group.live = None  # one range: nothing left to move
        self.metrics.fallbacks.labels("peer_memory_unusable").inc()
        return pb.PeerCheckVerdict(peer_memory_ok=False, reason=reason, thresholds=group.table.to_proto())
