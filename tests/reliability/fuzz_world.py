"""The real state the RPC fuzzers aim at: a world-1 and a world-2 group with live sessions and
allocations (the `world` fixture, registered in conftest.py), and targets that name it, one field
changed, or wild ones (tests/reliability/test_fuzz_rpc.py)."""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from dataclasses import dataclass, field

import pytest
from hypothesis import strategies as st

from conftest import join_request, reserved_bytes
from nodecomm.client.descriptors import claim_descriptors
from nodecomm.v1 import control_pb2 as pb

from .harness import Checked, SessionStream, fd_count
from .rpc_strategies import GROUP_NAMES, INT32, UINT64

# -- the real state the fuzzers aim at ---------------------------------------------------------------


@dataclass
class Allocation:
    allocation_id: int
    size: int
    view: mmap.mmap  # the test's own mapping of the daemon's memfd


@dataclass
class RealGroup:
    name: str
    group_id: int
    world_size: int
    sessions: dict[int, SessionStream] = field(default_factory=dict)
    # The service path's sequences the daemon has seen, to steer submits at the next one.
    consumed: set[int] = field(default_factory=set)
    next_sequence: int = 0
    exchanges: int = 100  # top-k exchange sequences used (the fuzzer's wild ones are mostly below)

    def ids(self, rank: int = 0) -> dict:
        return dict(group=self.name, group_id=self.group_id, rank=rank)

    def consume(self, sequence: int) -> None:
        self.consumed.add(sequence)
        while self.next_sequence in self.consumed:
            self.next_sequence += 1


@dataclass
class World:
    solo: RealGroup  # world 1: its submits run at once
    pair: RealGroup  # world 2: a rank's submit waits for its peer, who never comes
    target: Allocation  # solo rank 0's: the fuzzed submits' output
    canary: Allocation  # solo rank 0's: named only as input, never as output
    freed: int  # solo rank 0's, freed before fuzzing
    pair0: Allocation  # pair rank 0's
    pair1: Allocation  # pair rank 1's
    baseline_reserved: float
    baseline_fds: int
    # Groups the fuzzed joins formed: (name, id, world_size); their ranks never open sessions.
    formed: list[tuple[str, int, int]] = field(default_factory=list)
    spare: list[tuple[dict, int]] = field(default_factory=list)  # fuzzed allocations kept: (ids, id)
    freed_ids: list[int] = field(default_factory=list)

    @property
    def protected(self) -> set[int]:
        """Allocations the fuzzers may name in anything but FreeMemory."""
        return {a.allocation_id for a in (self.target, self.canary, self.pair0, self.pair1)}


def allocate(checked: Checked, group: RealGroup, rank: int, size: int, fill: bytes) -> Allocation:
    reply = checked.stub.AllocateMemory(pb.AllocateMemoryRequest(**group.ids(rank), size_bytes=size), timeout=10)
    (fd,) = claim_descriptors(checked.daemon.descriptor_socket, reply.claim_token, 1, 5.0)
    view = mmap.mmap(fd, size)
    os.close(fd)
    view[:] = (fill * (size // len(fill) + 1))[:size]
    return Allocation(reply.allocation_id, size, view)


@pytest.fixture(scope="module")
def world(fuzz_daemon, checked) -> World:
    stub = checked.stub
    stub.ListGroups(pb.ListGroupsRequest(), timeout=5)  # connected: the baseline counts this channel
    baseline_reserved = reserved_bytes(fuzz_daemon)
    baseline_fds = fd_count(fuzz_daemon.process.pid)
    dtypes = (pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16)
    reply = stub.Join(join_request("fz-solo", 0, 1, capacity=4096, dtypes=dtypes), timeout=10)
    solo = RealGroup("fz-solo", reply.group_id, 1)
    solo.sessions[0] = SessionStream(stub, reply.group_id, 0)

    replies: dict[int, pb.JoinReply] = {}

    def join_pair(rank: int) -> None:
        replies[rank] = stub.Join(join_request("fz-pair", rank, 2, capacity=4096, dtypes=dtypes), timeout=10)

    threads = [threading.Thread(target=join_pair, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pair = RealGroup("fz-pair", replies[0].group_id, 2)
    for rank in (0, 1):
        pair.sessions[rank] = SessionStream(stub, pair.group_id, rank)
    for session in (*solo.sessions.values(), *pair.sessions.values()):
        session.wait_ready()

    target = allocate(checked, solo, 0, 64 << 10, os.urandom(4096))
    canary = allocate(checked, solo, 0, 4096, b"canary!\x00")
    freed = allocate(checked, solo, 0, 4096, b"\x00")
    stub.FreeMemory(pb.FreeMemoryRequest(**solo.ids(), allocation_id=freed.allocation_id), timeout=10)
    pair0 = allocate(checked, pair, 0, 4096, b"pair0")
    pair1 = allocate(checked, pair, 1, 4096, b"pair1")
    return World(solo, pair, target, canary, freed.allocation_id, pair0, pair1, baseline_reserved, baseline_fds)


def assert_groups_intact(checked: Checked, world: World) -> None:
    """The real groups are still formed with every session live, and the canaries are untouched."""
    reply = checked.call("ListGroups", pb.ListGroupsRequest())
    assert isinstance(reply, pb.ListGroupsReply), reply
    states = {g.group_id: (g.state, list(g.live_ranks)) for g in reply.groups}
    assert states.get(world.solo.group_id) == ("active", [0]), states.get(world.solo.group_id)
    assert states.get(world.pair.group_id) == ("active", [0, 1]), states.get(world.pair.group_id)
    assert bytes(world.canary.view) == (b"canary!\x00" * 512)


# -- targets: a real group's ids, one of them changed, or wild ones ------------------------------------


@st.composite
def targets(draw, world: World, *, real_only: bool = False) -> dict:
    """group, group_id and rank of a request: mostly a real group's, each field sometimes wild."""
    kinds = ["solo"] * 6 + ["pair"] * 2 + ([] if real_only else ["formed", "wild"])
    kind = draw(st.sampled_from(kinds))
    if kind == "wild":
        return dict(group=draw(GROUP_NAMES), group_id=draw(UINT64), rank=draw(INT32))
    # Pools that change as the daemon answers are indexed with plain numbers, so that every
    # example draws the same way whatever the pool holds (hypothesis replays examples).
    index = draw(st.integers(0, 63))
    if kind == "formed" and world.formed:
        name, group_id, world_size = world.formed[index % len(world.formed)]
    else:
        group = world.pair if kind == "pair" else world.solo
        name, group_id, world_size = group.name, group.group_id, group.world_size
    ids = dict(group=name, group_id=group_id, rank=draw(st.integers(0, 7)) % world_size)
    mutated = draw(st.sampled_from([None, None, None, "group", "group_id", "rank"]))
    if mutated == "group":
        ids["group"] = draw(GROUP_NAMES)
    elif mutated == "group_id":
        ids["group_id"] = draw(UINT64)
    elif mutated == "rank":
        ids["rank"] = draw(INT32)
    return ids


def group_of(world: World, ids: dict) -> RealGroup | None:
    for group in (world.solo, world.pair):
        if (ids["group"], ids["group_id"]) == (group.name, group.group_id) and 0 <= ids["rank"] < group.world_size:
            return group
    return None


_FRESH = itertools.count()


def fresh_group(checked: Checked) -> tuple[str, int]:
    """A world-1 group formed now, its session not open: the daemon drops its rank after the
    session grace period unless a fuzzed Session or Leave comes first. (name, group id)"""
    name = f"fz-fresh{next(_FRESH)}"
    return name, checked.stub.Join(join_request(name, 0, 1, capacity=4096), timeout=5).group_id
