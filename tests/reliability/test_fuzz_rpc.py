"""Every RPC of the control plane, driven with arbitrary field values against one real daemon.

Each answer must be a success or an allowed status with a short, non-empty message (never
UNKNOWN or INTERNAL: those mean an unhandled exception), and after every example the daemon must
still run and say SERVING. Real groups (world 1 and world 2, their sessions open) and real
allocations are built first, so that the fuzzed requests also hit ids that exist: nothing they
send may make the daemon write outside the output range it accepted, touch an allocation no
request names as output, or keep memory or descriptors once every rank has left.
"""

from __future__ import annotations

import os

import grpc
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from conftest import reserved_bytes
from nodecomm.topk_layout import owned_rows
from nodecomm.v1 import control_pb2 as pb
from waiting import wait_until

from .fuzz_world import Allocation, RealGroup, World, assert_groups_intact, fresh_group, group_of, targets
from .harness import Checked, fd_count, fuzz
from .rpc_strategies import (
    ANY_FLOAT,
    DTYPE,
    GROUP_NAMES,
    INT32,
    MAX_WORLD,
    OP,
    TEXT,
    UINT32,
    UINT64,
    edges_or,
    evidence,
    join_requests,
    timings,
)

# -- the fuzzers ------------------------------------------------------------------------------------


@fuzz(300)
@given(data=st.data())
def test_join(checked, world, data):
    request = data.draw(join_requests())
    # A join that looks valid waits for its peers: the deadline bounds what it may cost.
    reply = checked.call("Join", request, timeout=0.15)
    if isinstance(reply, pb.JoinReply):
        assert request.world_size == 1 and reply.group_id, (request, reply)
        # Its rank never opens a session: the daemon must drop it after the grace period.
        world.formed.append((request.group, reply.group_id, 1))
        del world.formed[:-20]
    checked.assert_alive()


@fuzz(40)
@given(data=st.data())
def test_ranks_joining_together_with_disagreements(checked, world, data):
    """Several ranks of one name at once, each request its own: agreement, mismatch, duplicates."""
    name = data.draw(st.sampled_from(["fz-storm", "fz-storm2"]))
    world_size = data.draw(st.integers(1, 4))
    requests = [data.draw(join_requests(name, world_size)) for _ in range(data.draw(st.integers(1, 4)))]
    futures = [checked.stub.Join.future(r, timeout=0.3) for r in requests]
    for request, future in zip(requests, futures, strict=True):
        try:
            reply = future.result()
        except grpc.RpcError as error:
            checked.check_status("Join", error, request)
        else:
            checked.succeeded("Join")
            world.formed.append((name, reply.group_id, request.world_size))
    checked.count("Join", len(requests))
    checked.assert_alive()


@fuzz(150)
@given(data=st.data())
def test_session_streams(checked, world, data):
    hello_targets = st.one_of(
        st.builds(pb.SessionHello, group_id=UINT64, rank=INT32),
        st.sampled_from([(g, 0) for g in (world.solo.group_id, world.pair.group_id)] or [(0, 0)]).map(
            lambda t: pb.SessionHello(group_id=t[0], rank=t[1])
        ),
        st.integers(0, 19).map(
            lambda i: pb.SessionHello(group_id=world.formed[i % len(world.formed)][1] if world.formed else 0, rank=0)
        ),
    )
    message = st.one_of(
        hello_targets.map(lambda h: pb.SessionUp(hello=h)),
        timings().map(lambda t: pb.SessionUp(timings=t)),
        st.just(pb.SessionUp()),
    )
    messages = data.draw(st.lists(message, max_size=6))
    if data.draw(st.booleans()):  # first a hello for a group that just formed, its session not open
        _, group_id = fresh_group(checked)
        rank = data.draw(st.sampled_from([0, 0, 0, 1, -1]))
        messages.insert(0, pb.SessionUp(hello=pb.SessionHello(group_id=group_id, rank=rank)))
    received, code = checked.stream("Session", iter(messages), timeout=4)
    if code is None:  # accepted: it must have been a hello for a rank that had no session yet
        assert messages and messages[0].WhichOneof("kind") == "hello", messages
        assert received and received[0].event.kind == pb.READY, received
    checked.assert_alive()


@fuzz(150)
@given(batch=st.one_of(timings(), evidence()))
def test_timings_on_a_live_session(checked, world, batch):
    """Whatever a rank reports as its timings, its session must stay open."""
    for session in (world.solo.sessions[0], *world.pair.sessions.values()):
        session.send(pb.SessionUp(timings=batch))
    assert_groups_intact(checked, world)
    checked.assert_alive()


def test_the_sessions_survived_the_timings_and_evidence_offers_every_rank_the_new_table(checked, world):
    """After whatever the fuzzers sent, every session is open, and evidence that twoshot wins at
    4 KiB (oneshot's range in the built-in table) moves the boundary: every rank of a group is
    offered the same tables. (Where earlier evidence moved it there already, those tables.)"""
    oneshot_loses = pb.TimingBatch(
        timings=[pb.Timing(path=pb.ONESHOT, bytes=4096, seconds=1e-3)] * 40
        + [pb.Timing(path=pb.TWOSHOT, bytes=4096, seconds=1e-6)] * 40
    )
    for group in (world.solo, world.pair):
        for session in group.sessions.values():
            session.send(pb.SessionUp(timings=oneshot_loses))

    def epochs(group: RealGroup) -> list[tuple[int, ...]]:
        return [
            tuple(m.thresholds.epoch for m in session.received if m.HasField("thresholds"))
            for session in group.sessions.values()
        ]

    for group in (world.solo, world.pair):
        wait_until(
            lambda group=group: all(epochs(group)) and len(set(epochs(group))) == 1,
            30,
            f"every rank of group {group.name!r} offered the same new tables",
        )
    assert_groups_intact(checked, world)
    for group in (world.solo, world.pair):
        assert all(session.open and session.error is None for session in group.sessions.values())


def _reference(world: World, allocation_id: int) -> Allocation | None:
    for allocation in (world.target, world.canary, world.pair0, world.pair1):
        if allocation.allocation_id == allocation_id:
            return allocation
    return None


@st.composite
def memory_refs(draw, world: World, *, output: bool) -> pb.MemoryRef | None:
    choices = ["target", "target", "freed", "pair0", "pair1", "wild", "absent"] + ([] if output else ["canary"])
    kind = draw(st.sampled_from(choices))
    if kind == "absent":
        return None
    allocation_id = {
        "target": world.target.allocation_id,
        "canary": world.canary.allocation_id,
        "freed": world.freed,
        "pair0": world.pair0.allocation_id,
        "pair1": world.pair1.allocation_id,
    }.get(kind)
    if allocation_id is None:
        allocation_id = draw(UINT64.filter(lambda a: a != world.canary.allocation_id))
    size = 64 << 10
    offset = draw(
        st.one_of(
            st.sampled_from([0, 0, 4, 64, 4092, 4096, size - 64, size - 4, size, size + 4]),
            st.integers(0, size // 4).map(lambda n: n * 4),
            UINT64,
        )
    )
    return pb.MemoryRef(allocation_id=allocation_id, offset_bytes=offset)


def _output_bytes(request: pb.SubmitRequest, world_size: int) -> int:
    """How many bytes an accepted submit may write at its output offset."""
    element = ELEMENT_BYTES.get(request.dtype, 1)
    if request.op == pb.ALL_REDUCE:
        return request.count * element
    if request.op == pb.ALL_GATHER:
        return request.count * world_size
    rows = owned_rows(request.count, world_size, request.rank)
    return 2 * (rows.stop - rows.start) * world_size * request.topk * 4


ELEMENT_BYTES = {pb.FLOAT32: 4, pb.FLOAT16: 2, pb.BFLOAT16: 2}


@st.composite
def shapes(draw) -> dict:
    """What the ranks of one collective agree on: op, dtype, topk and count."""
    op = draw(st.sampled_from([pb.ALL_REDUCE, pb.ALL_REDUCE, pb.ALL_GATHER, pb.TOPK_STAGE]))
    return dict(
        op=op,
        dtype=draw(st.sampled_from(sorted(ELEMENT_BYTES))) if op == pb.ALL_REDUCE else pb.DTYPE_UNSPECIFIED,
        topk=draw(st.integers(1, 4)) if op == pb.TOPK_STAGE else 0,
        count=draw(st.one_of(st.integers(0, 64), st.integers(0, 20000))),
    )


@st.composite
def submits(
    draw, world: World, ids: dict | None = None, shape: dict | None = None, max_mutations: int = 3
) -> tuple[pb.SubmitRequest, RealGroup | None]:
    """A submit a real rank would send (its own allocations, ranges that fit or just do not, the
    next sequence), with up to three of its fields replaced by wild values; and its group."""
    ids = ids or draw(targets(world, real_only=draw(st.booleans())))
    group = group_of(world, ids)
    shape = shape or draw(shapes())
    op = shape["op"]
    request = pb.SubmitRequest(**ids, **shape, timeout_seconds=draw(st.floats(0.005, 0.05)))
    delta = draw(st.one_of(st.just(0), st.just(0), st.just(0), st.integers(-2, 2), st.integers(60, 70)))
    request.sequence = max(0, (group.next_sequence if group is not None else 0) + delta)
    if group is world.pair:
        inputs = outputs = [world.pair0 if ids["rank"] == 0 else world.pair1]
    else:
        inputs, outputs = [world.target, world.canary], [world.target]
    align = ELEMENT_BYTES[request.dtype] if op == pb.ALL_REDUCE else (1 if op == pb.ALL_GATHER else 4)
    source, sink = draw(st.sampled_from(inputs)), draw(st.sampled_from(outputs))
    in_offset = draw(st.integers(0, source.size // align)) * align
    in_place = source is sink and draw(st.booleans())
    out_offset = in_offset if in_place else draw(st.integers(0, sink.size // align)) * align
    request.input.CopyFrom(pb.MemoryRef(allocation_id=source.allocation_id, offset_bytes=in_offset))
    request.output.CopyFrom(pb.MemoryRef(allocation_id=sink.allocation_id, offset_bytes=out_offset))

    mutations = {
        "sequence": UINT64,
        "op": OP,
        "dtype": DTYPE,
        "count": UINT64,
        "topk": UINT32,
        "input": memory_refs(world, output=False),
        "output": memory_refs(world, output=True),
        "timeout_seconds": ANY_FLOAT,
    }
    for name in draw(st.lists(st.sampled_from(sorted(mutations)), max_size=max_mutations, unique=True)):
        value = draw(mutations[name])
        if name in ("input", "output"):
            request.ClearField(name)
            if value is not None:
                getattr(request, name).CopyFrom(value)
        else:
            setattr(request, name, value)
    return request, group


def _after_every_collective_before(checked: Checked, group: RealGroup) -> None:
    """Returns once no collective `group` was sent so far runs or waits any more: a group runs its
    collectives in sequence order, so empty ones of every rank at its next sequence are answered
    only after every earlier one ran or failed. DEADLINE_EXCEEDED: an earlier one never reached the
    daemon (its caller gave up before it was sent), which leaves nothing of it to run either."""
    sequence = group.next_sequence
    requests = [
        pb.SubmitRequest(
            **group.ids(rank), sequence=sequence, op=pb.ALL_REDUCE, dtype=pb.FLOAT32, count=0, timeout_seconds=10
        )
        for rank in range(group.world_size)
    ]
    futures = [checked.stub.Submit.future(request, timeout=60) for request in requests]
    checked.count("Submit", len(futures))
    for request, future in zip(requests, futures, strict=True):
        try:
            future.result()
        except grpc.RpcError as error:
            code = checked.check_status("Submit", error, request)
            # Past the group's queue, or already run: the group's next collective is past it too.
            assert code in (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.ALREADY_EXISTS,
            ), (code, error.details())
        else:
            checked.succeeded("Submit")
    group.consume(sequence)


@fuzz(600)
@given(data=st.data())
def test_submit(checked, world, data):
    request, group = data.draw(submits(world))
    # Now and then the caller gives up before the daemon answers (its part must not linger).
    deadline = data.draw(st.sampled_from([10.0, 10.0, 10.0, 10.0, 0.02]))
    views = (world.target, world.pair0, world.pair1)
    before = {a.allocation_id: bytes(a.view) for a in views}

    reply = checked.call("Submit", request, timeout=deadline)

    sequence = request.sequence
    if group is not None and group.next_sequence <= sequence < group.next_sequence + 64 + 256:
        group.consume(sequence)  # created, and now done: it ran, failed, timed out or was abandoned
    # What the daemon may have written: the accepted output range, and nothing else anywhere.
    written = range(0)
    gave_up = deadline < 1 and reply == grpc.StatusCode.DEADLINE_EXCEEDED
    if gave_up:
        if group is not None:  # a collective already running when the caller left finishes
            _after_every_collective_before(checked, group)
        if request.output.allocation_id == world.target.allocation_id and group is world.solo:
            start = request.output.offset_bytes
            written = range(start, start + _output_bytes(request, 1))
    if isinstance(reply, pb.SubmitReply) and request.count:
        assert group is world.solo and request.output.allocation_id == world.target.allocation_id, request
        start = request.output.offset_bytes
        written = range(start, start + _output_bytes(request, 1))
        if request.op == pb.ALL_GATHER:  # one rank: its own bytes, from where it said they were
            source = request.input
            old = before.get(source.allocation_id) or bytes(_reference(world, source.allocation_id).view)
            got = bytes(world.target.view[written.start : written.stop])
            assert got == old[source.offset_bytes : source.offset_bytes + request.count], request
    for allocation in views:
        old, new = before[allocation.allocation_id], bytes(allocation.view)
        if new != old:
            changed = [i for i in range(len(old)) if old[i] != new[i]]
            assert allocation is world.target and changed[0] in written, (request, changed[:8])
            assert changed[-1] in written, (request, changed[-8:])
    assert bytes(world.canary.view) == b"canary!\x00" * 512
    checked.assert_alive()


@fuzz(200)
@given(data=st.data())
def test_both_ranks_of_a_pair_submit_at_once(checked, world, data):
    """The pair's ranks submit the same collective together, now and then a field differing: it
    runs (each rank's output written, only there) or fails for both, and nothing else changes."""
    pair, shape = world.pair, data.draw(shapes())
    requests = [
        data.draw(submits(world, pair.ids(rank), shape, max_mutations=data.draw(st.sampled_from([0, 0, 1, 2]))))[0]
        for rank in (0, 1)
    ]
    views = {0: world.pair0, 1: world.pair1}
    before = {rank: bytes(view.view) for rank, view in views.items()}
    futures = [checked.stub.Submit.future(request, timeout=10) for request in requests]
    checked.count("Submit", 2)
    ok = []
    for request, future in zip(requests, futures, strict=True):
        try:
            future.result()
        except grpc.RpcError as error:
            checked.check_status("Submit", error, request)
        else:
            checked.succeeded("Submit")
            ok.append(request.rank)
        if pair.next_sequence <= request.sequence < pair.next_sequence + 64 + 256:
            pair.consume(request.sequence)
    assert ok in ([], [0, 1]), (ok, requests)  # one collective: every rank's answer is the same
    for rank, view in views.items():
        request = requests[rank]
        written = range(0)
        if ok and request.count:
            assert request.output.allocation_id == view.allocation_id, request
            start = request.output.offset_bytes
            written = range(start, start + _output_bytes(request, 2))
            if request.op == pb.ALL_GATHER:  # rank 0's bytes, then rank 1's
                parts = [
                    before[r][requests[r].input.offset_bytes : requests[r].input.offset_bytes + request.count]
                    for r in (0, 1)
                ]
                assert bytes(view.view[written.start : written.stop]) == b"".join(parts), requests
        old, new = before[rank], bytes(view.view)
        if new != old:
            changed = [i for i in range(len(old)) if old[i] != new[i]]
            assert changed[0] in written and changed[-1] in written, (requests, changed[:4], changed[-4:])
    assert bytes(world.canary.view) == b"canary!\x00" * 512
    checked.assert_alive()


@fuzz(200)
@given(data=st.data())
def test_allocate_and_free(checked, world, data):
    ids = data.draw(targets(world))
    if data.draw(st.booleans()):
        size = data.draw(edges_or(0, 2**64 - 1, 1, 4096, 16 << 20, (16 << 20) + 1, 32 << 20, (32 << 20) + 1))
        reply = checked.call("AllocateMemory", pb.AllocateMemoryRequest(**ids, size_bytes=size))
        if isinstance(reply, pb.AllocateMemoryReply):
            assert group_of(world, ids) is not None and reply.size_bytes == size, (ids, reply)
            world.spare.append((ids, reply.allocation_id))
            while len(world.spare) > 6:  # keep the quota for the others
                owner, allocation_id = world.spare.pop(0)
                freed = checked.call("FreeMemory", pb.FreeMemoryRequest(**owner, allocation_id=allocation_id))
                assert isinstance(freed, pb.FreeMemoryReply), freed
                world.freed_ids.append(allocation_id)
    else:
        pool = [a for _, a in world.spare] + world.freed_ids[-5:] + [world.freed]
        allocation_id = data.draw(st.one_of(st.integers(0, 63).map(lambda i: pool[i % len(pool)]), UINT64))
        if allocation_id in world.protected:
            allocation_id = world.freed
        reply = checked.call("FreeMemory", pb.FreeMemoryRequest(**ids, allocation_id=allocation_id))
        if isinstance(reply, pb.FreeMemoryReply):
            world.spare = [(g, a) for g, a in world.spare if a != allocation_id]
            world.freed_ids.append(allocation_id)
    checked.assert_alive()


TOPK_MUTATIONS = {
    "sequence": UINT32,
    "max_rows": UINT32,
    "topk": UINT32,
    "layout_version": UINT32,
    "timeout_seconds": ANY_FLOAT,
}


@st.composite
def topk_exchanges(draw, ids: dict, sequence: int, geometry: tuple[int, int]) -> pb.TopkExchangeRequest:
    request = pb.TopkExchangeRequest(
        **ids,
        sequence=sequence,
        max_rows=geometry[0],
        topk=geometry[1],
        layout_version=1,
        timeout_seconds=draw(st.floats(0.005, 0.05)),
    )
    for name in draw(st.lists(st.sampled_from(sorted(TOPK_MUTATIONS)), max_size=2, unique=True)):
        setattr(request, name, draw(TOPK_MUTATIONS[name]))
    return request


@fuzz(200)
@given(data=st.data())
def test_open_topk_exchange(checked, world, data):
    """One rank's call, or (the pair) both ranks' at once, each with its own wild fields."""
    ids = data.draw(targets(world))
    group = group_of(world, ids)
    if group is not None:
        group.exchanges += 1  # a new exchange: the group's earlier ones are formed or failed
    sequence = group.exchanges if group is not None else data.draw(UINT32)
    geometry = (data.draw(st.integers(1, 64)), data.draw(st.integers(1, 16)))
    ranks = [ids["rank"]]
    if group is world.pair and data.draw(st.booleans()):
        ranks = [0, 1]
    requests = [data.draw(topk_exchanges({**ids, "rank": rank}, sequence, geometry)) for rank in ranks]
    futures = [checked.stub.OpenTopkExchange.future(r, timeout=0.3 if group is world.pair else 5) for r in requests]
    checked.count("OpenTopkExchange", len(requests))
    for request, future in zip(requests, futures, strict=True):
        try:
            future.result()
        except grpc.RpcError as error:
            checked.check_status("OpenTopkExchange", error, request)
        else:
            checked.succeeded("OpenTopkExchange")
    checked.assert_alive()


@fuzz(300)
@given(data=st.data())
def test_the_other_calls(checked, world, data):
    method = data.draw(st.sampled_from(["Leave", "CheckPeers", "GetThresholds", "ListGroups", "Calibrate"]))
    if method == "Leave":
        ids = data.draw(targets(world))
        if group_of(world, ids) is not None:
            ids["group_id"] ^= 1  # never the real groups' ranks: the others still use them
        if data.draw(st.booleans()):  # a group that just formed, its ids now and then changed
            name, group_id = fresh_group(checked)
            ids = dict(group=name, group_id=group_id, rank=0)
            mutated = data.draw(st.sampled_from([None, None, "group", "group_id", "rank"]))
            if mutated is not None:
                ids[mutated] = data.draw({"group": GROUP_NAMES, "group_id": UINT64, "rank": INT32}[mutated])
        for _ in range(data.draw(st.integers(1, 2))):  # the second time, the rank has left
            checked.call("Leave", pb.LeaveRequest(**ids))
    elif method == "CheckPeers":
        report = pb.PeerCheckReport(
            **data.draw(targets(world)), ok=data.draw(st.booleans()), detail=data.draw(TEXT), stage=data.draw(INT32)
        )
        checked.call("CheckPeers", report, timeout=3)
    elif method == "GetThresholds":
        request = pb.GetThresholdsRequest(
            group=data.draw(st.one_of(st.just(""), st.just("fz-solo"), GROUP_NAMES)),
            device_kind=data.draw(st.one_of(st.sampled_from(["", "cpu", "cuda", "tpu"]), TEXT)),
            nccl_fallback=data.draw(st.booleans()),
        )
        reply = checked.call("GetThresholds", request)
        if isinstance(reply, pb.ThresholdTable):
            assert reply.ranges and reply.ranges[-1].unbounded, reply
    elif method == "ListGroups":
        reply = checked.call("ListGroups", pb.ListGroupsRequest())
        assert isinstance(reply, pb.ListGroupsReply), reply
    else:
        request = _refused_calibration(data)
        received, code = checked.stream("Calibrate", request, timeout=5)
        assert code is not None and not received, f"a calibration ran for {request}"
    checked.assert_alive()


def _refused_calibration(data) -> pb.CalibrateRequest:
    """A CalibrateRequest the daemon must refuse before probing (a real probe takes minutes)."""
    request = pb.CalibrateRequest(
        device_kind=data.draw(st.one_of(st.sampled_from(["", "cpu", "cuda"]), TEXT)),
        world_size=data.draw(INT32),
        min_bytes=data.draw(UINT64),
        max_bytes=data.draw(UINT64),
    )
    world_size = request.world_size or 2
    low, high = request.min_bytes or 4 << 10, request.max_bytes or 64 << 20
    if (request.device_kind or "cpu") in ("cpu", "cuda") and 2 <= world_size <= MAX_WORLD and 4 <= low <= high:
        request.world_size = data.draw(st.sampled_from([1, -1, MAX_WORLD + 1, 2**31 - 1]))
    return request


CONTROL = pb.DESCRIPTOR.services_by_name["Control"]


def _raw_request(method: str, payload: bytes) -> bytes:
    """`payload` as it goes out, except a Calibrate it would start (a real probe takes minutes)."""
    if method != "Calibrate":
        return payload
    try:
        request = pb.CalibrateRequest.FromString(payload)
    except DecodeError:
        return payload
    world_size = request.world_size or 2
    low, high = request.min_bytes or 4 << 10, request.max_bytes or 64 << 20
    if (request.device_kind or "cpu") in ("cpu", "cuda") and 2 <= world_size <= MAX_WORLD and 4 <= low <= high:
        request.world_size = MAX_WORLD + 1
    return request.SerializeToString()


@fuzz(200)
@given(
    method=st.sampled_from([m.name for m in CONTROL.methods]),
    payload=st.one_of(
        st.binary(max_size=300),
        st.builds(
            lambda head, body: head + body, st.sampled_from([b"\n", b"\x08", b"\x12\xff\xff\xff\xff\x0f"]), st.binary()
        ),
    ),
)
def test_bytes_that_are_not_a_request(checked, world, method, payload):
    """Any bytes as a request message (most do not parse; those that do are odd requests)."""
    payload = _raw_request(method, payload)
    descriptor = CONTROL.methods_by_name[method]
    path = f"/{CONTROL.full_name}/{method}"
    channel = checked.channel
    checked.count(method)
    try:
        if descriptor.client_streaming:
            list(channel.stream_stream(path)(iter([payload]), timeout=3))
        elif descriptor.server_streaming:
            received = list(channel.unary_stream(path)(payload, timeout=3))
            assert not received, f"a calibration ran for {payload!r}"
        else:
            channel.unary_unary(path)(payload, timeout=0.3 if method in ("Join", "OpenTopkExchange") else 3)
    except grpc.RpcError as error:
        checked.check_status(method, error, payload)
    else:
        checked.succeeded(method)
    checked.assert_alive()


# -- afterwards: every rank leaves, and everything goes back ------------------------------------------


def test_everything_is_released_after_every_rank_leaves(fuzz_daemon, checked, world):
    assert_groups_intact(checked, world)
    stub = checked.stub
    for group in (world.solo, world.pair):
        for rank, session in group.sessions.items():
            stub.Leave(pb.LeaveRequest(**group.ids(rank)), timeout=10)
            session.close()
    for allocation in (world.target, world.canary, world.pair0, world.pair1):
        allocation.view.close()

    def released() -> bool:
        reply = stub.ListGroups(pb.ListGroupsRequest(), timeout=5)
        return not reply.groups

    # The fuzzed joins' groups go once their session grace ends; unclaimed tokens once they expire.
    wait_until(released, 10, "every group released")
    assert reserved_bytes(fuzz_daemon) == world.baseline_reserved
    pid = fuzz_daemon.process.pid
    try:
        wait_until(lambda: fd_count(pid) <= world.baseline_fds, 10, "the daemon's descriptors back to baseline")
    except AssertionError:
        raise AssertionError(
            f"{fd_count(pid)} descriptors open, {world.baseline_fds} at the start: "
            + str(sorted(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")))
        ) from None
    checked.assert_alive()
