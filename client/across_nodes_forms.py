"""Which form an all-reduce across nodes takes at a size, and how the boundary between the two
forms follows the machine.

    flat      every node's whole sum crosses between nodes: one inter-node step, no last step
    sharded   each cross group carries one shard; the node's ranks then gather the shards

Flat wins small messages (a step fewer), sharded large ones (each rank moves 1/S of the bytes
between nodes). The boundary, flat_max_bytes, comes from the caller or from a probe the ranks run
when they connect, and then moves with live timings by the daemon's own rules and defaults
(nodecomm.evidence: LivePolicy, the same evidence and size buckets), with rank 0 the one rank that
times (a collective ends on every rank within one exchange of the others): every
explore_period-th call near the boundary takes the other form; where the form the table gives a
bucket loses to the other by more than the margin, with min_samples of each, the boundary moves
so that the winner takes the bucket, and the bucket's evidence is dropped (so nothing moves back
before new timings say so). After every switch_period-th call rank 0 puts the table in the job's
store and every rank takes it before its next call, so all ranks decide every call alike. Both forms
give the same bits, so exploring changes no result.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from nodecomm.byte_size import format_byte_size
from nodecomm.evidence import Evidence, LivePolicy, beats, bucket_index, bucket_range


class Form(enum.Enum):
    FLAT = "flat"
    SHARDED = "sharded"

    @property
    def other(self) -> Form:
        return Form.SHARDED if self is Form.FLAT else Form.FLAT


@dataclass(frozen=True)
class AcrossNodesTable:
    """Up to flat_max_bytes flat, above it sharded. source: where the boundary came from
    ("caller", "probe", "live", or "one shard" where the forms are the same); epoch: how many
    times it moved since the ranks connected."""

    flat_max_bytes: int
    source: str
    epoch: int = 0

    def form_for(self, nbytes: int) -> Form:
        return Form.FLAT if nbytes <= self.flat_max_bytes else Form.SHARDED

    def rows(self) -> list[tuple[int, int | None, Form]]:
        """The table's ranges: (lowest bytes, highest bytes or None for no limit, form)."""
        if self.flat_max_bytes <= 0:
            return [(0, None, Form.SHARDED)]
        return [(0, self.flat_max_bytes, Form.FLAT), (self.flat_max_bytes + 1, None, Form.SHARDED)]

    def encoded(self) -> bytes:
        return f"{self.flat_max_bytes} {self.epoch} {self.source}".encode()

    @classmethod
    def decoded(cls, raw: bytes) -> AcrossNodesTable:
        flat_max, epoch, source = raw.decode().split(" ", 2)
        return cls(int(flat_max), source, int(epoch))

    def __str__(self) -> str:
        if self.flat_max_bytes <= 0:
            return f"sharded at every size ({self.source}, epoch {self.epoch})"
        return f"flat up to {format_byte_size(self.flat_max_bytes)}, sharded above ({self.source}, epoch {self.epoch})"


def probe_boundary(flat_seconds: dict[int, float], sharded_seconds: dict[int, float]) -> int:
    """The boundary a probe's timings give: the largest size up to which flat won at every probed
    size (0: sharded won even the smallest)."""
    boundary = 0
    for nbytes in sorted(flat_seconds):
        if flat_seconds[nbytes] > sharded_seconds[nbytes]:
            break
        boundary = nbytes
    return boundary


@dataclass
class AcrossNodesForms:
    """Decides every all-reduce of one rank across nodes, and (on the rank that times) proposes
    moves from live timings. `live`: whether calls explore and the boundary moves; every rank
    must pass the same table and settings."""

    table: AcrossNodesTable
    live: bool = True
    policy: LivePolicy = LivePolicy()
    reach: int = 3  # buckets either side of the boundary's that explore
    calls: int = 0  # all-reduces decided: the same count on every rank
    evidence: Evidence[Form] = field(init=False)

    def __post_init__(self) -> None:
        # rank 0's timings: the collective ends on every rank alike
        self.evidence = Evidence(1, self.policy.min_samples)

    def decide(self, nbytes: int) -> tuple[Form, bool]:
        """The form of the next all-reduce of `nbytes`, and whether it explores; counts the call."""
        self.calls += 1
        form = self.table.form_for(nbytes)
        boundary_bucket = bucket_index(self.table.flat_max_bytes + 1)
        explore = (
            self.live
            and self.calls % self.policy.explore_period == 0
            and abs(bucket_index(nbytes) - boundary_bucket) <= self.reach
        )
        return (form.other, True) if explore else (form, False)

    def record(self, form: Form, nbytes: int, seconds: float) -> None:
        self.evidence.add(0, form, nbytes, seconds)

    def switch_due(self) -> bool:
        return self.live and self.calls % self.policy.switch_period == 0

    def proposed(self) -> AcrossNodesTable:
        """The table after the first move the evidence demands, bucket by bucket from the
        smallest; the current one where none does."""
        flat_max = self.table.flat_max_bytes
        for bucket in self.evidence.buckets():
            low, high = bucket_range(bucket)
            if low <= flat_max < high:
                continue  # a bucket the boundary splits: no clean comparison
            current = self.table.form_for(high)
            mine, theirs = self.evidence.estimate(current, bucket), self.evidence.estimate(current.other, bucket)
            if mine is None or theirs is None or not beats(theirs, mine, self.policy.margin):
                continue
            moved = high if current is Form.SHARDED else low - 1
            below, above = sorted((flat_max, moved))
            # every bucket whose form this changes starts over
            self.evidence.forget(lambda bucket, below=below, above=above: below < bucket_range(bucket)[1] <= above)
            return AcrossNodesTable(moved, "live", self.table.epoch + 1)
        return self.table
