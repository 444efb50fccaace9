"""Who a rank is in its group: what the Communicator, its session, its service client and its
exchanges name in every call to the daemon and in every error they raise."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Membership:
    group: str
    group_id: int  # the daemon's id of this forming of the group
    rank: int
    world_size: int

    @property
    def where(self) -> dict:
        """What nodecomm.errors' classes take to say which group and rank raised."""
        return {"group": self.group, "rank": self.rank}
