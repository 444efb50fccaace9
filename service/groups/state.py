"""A group's state, as ListGroups (GroupInfo.state) and the nodecomm_groups metric name it."""

from __future__ import annotations

from enum import Enum


class GroupState(str, Enum):
    """Where a group is in its life, as ListGroups and the metrics name it: ranks still arriving
    (a forming group, before there is a Group), formed and serving, or aborted (a rank was lost or
    left, or the daemon is draining) until every rank has left."""

    JOINING = "joining"
    ACTIVE = "active"
    ABORTED = "aborted"

    def __str__(self) -> str:
        return self.value
