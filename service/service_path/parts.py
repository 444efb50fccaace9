"""One rank's part of a service-path collective: its request, and its input and output ranges
checked against the rank's allocations."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nodecomm.service.memory.allocator import RankAllocation
from nodecomm.v1 import control_pb2 as pb


@dataclass
class Part:
    """One rank's request, its ranges checked: (allocation, address) of input and output."""

    request: pb.SubmitRequest
    input: tuple[RankAllocation, int] | None
    output: tuple[RankAllocation, int] | None
    in_bytes: int  # what this rank contributes

    def allocations(self) -> Iterable[RankAllocation]:
        return [ref[0] for ref in (self.input, self.output) if ref is not None]
