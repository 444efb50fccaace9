"""What the daemon shows of its groups (ListGroups, `nodecomm status`): a caller's own, or every
group with its owner to an operator. A forming group's world size and joined ranks say which rank
to pose as, so they are shown only to an operator or to a caller that holds the group's key."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from nodecomm.service.access.callers import Caller
from nodecomm.service.groups.group import Group
from nodecomm.service.groups.joining import FormingGroup
from nodecomm.v1 import control_pb2 as pb


def group_infos(
    forming_groups: Iterable[FormingGroup], groups: Iterable[Group], caller: Caller, operator: bool, group_key: bytes
) -> list[pb.GroupInfo]:
    """`caller`'s groups, or every group (with its owner) for an `operator`; forming ones with
    their world size and joined ranks only for an operator or where `group_key` is theirs (a
    member asks): to anyone else those say which rank to pose as."""
    key_digest = hashlib.sha256(group_key).digest() if group_key else b""
    owned = [
        (
            forming.creator,
            forming.info(operator or (bool(key_digest) and hmac.compare_digest(forming.key_digest, key_digest))),
        )
        for forming in forming_groups
        if forming.arrivals
    ]
    owned += [(group.creator, group.info()) for group in groups]
    if operator:
        for owner, info in owned:
            info.owner = str(owner)
    return [info for owner, info in owned if operator or owner == caller]
