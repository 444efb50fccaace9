"""One test per bug the fuzzers found, each with the input that found it, against one daemon."""

from __future__ import annotations

import os
import socket
import threading

import grpc
import pytest

from conftest import join_request
from nodecomm.client.descriptors import claim_descriptors
from nodecomm.credentials import rank_metadata
from nodecomm.v1 import control_pb2 as pb
from waiting import wait_until

from .harness import Checked, SessionStream


def refused(checked: Checked, method: str, request: object, timeout: float = 5.0) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        getattr(checked.stub, method)(request, timeout=timeout)
    checked.assert_alive()
    return raised.value


def handled_calls(daemon, method: str) -> float:
    """How many `method` calls the daemon's handler has ended (each is timed as it ends)."""
    return daemon.metric(f'nodecomm_rpc_seconds_count{{method="{method}"}}')


def wait_for_the_call_given_up(daemon, method: str, handled: float) -> None:
    """Until the daemon has ended its handling of the `method` call its caller gave up on (`handled`
    calls ended before it): it has then withdrawn the caller's part (service/groups/rendezvous.py)."""
    wait_until(
        lambda: handled_calls(daemon, method) > handled,
        30,
        lambda: f"the daemon ended the {method} call its caller gave up on ({handled_calls(daemon, method)} ended)",
    )


def test_an_override_named_twice_once_without_a_value_is_invalid_not_unknown(checked):
    # Found by test_join: sorting the overrides compared None (off) with an int -> UNKNOWN.
    request = join_request("twice", 0, 1, capacity=4096)
    request.overrides.add(name="oneshot_max_bytes")
    request.overrides.add(name="oneshot_max_bytes", value_bytes=1)
    error = refused(checked, "Join", request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "overrides ['oneshot_max_bytes', 'oneshot_max_bytes']: expected each of" in error.details()


LONG = "\u65e5" * 100_000  # 300 KB of UTF-8, 600 KB once percent-encoded in a trailer


@pytest.mark.parametrize(
    "method, request_, code, expected",
    [
        # Found by test_submit and test_allocate_and_free: the group name came back twice, whole.
        ("AllocateMemory", pb.AllocateMemoryRequest(group=LONG), "NOT_FOUND", "with id 0 has this rank"),
        ("FreeMemory", pb.FreeMemoryRequest(group=LONG), "NOT_FOUND", "with id 0 has this rank"),
        ("Submit", pb.SubmitRequest(group=LONG), "NOT_FOUND", "with id 0 has this rank"),
        ("Leave", pb.LeaveRequest(group=LONG), "NOT_FOUND", "no group named"),
        ("OpenTopkExchange", pb.TopkExchangeRequest(group=LONG), "NOT_FOUND", "with id 0 has this rank"),
        ("CheckPeers", pb.PeerCheckReport(group=LONG), "NOT_FOUND", "with id 0 has this rank"),
        ("GetThresholds", pb.GetThresholdsRequest(group=LONG), "NOT_FOUND", "no active group named"),
        # Found by test_the_other_calls: the device kind came back whole (service/calibration/tables.py).
        ("GetThresholds", pb.GetThresholdsRequest(device_kind=LONG), "INVALID_ARGUMENT", "expected 'cpu' or 'cuda'"),
        # Found by test_join: every unknown dtype and override name came back.
        (
            "Join",
            join_request("long", 0, 1, dtypes=list(range(5, 3000))),
            "INVALID_ARGUMENT",
            "(2995 items): expected one or more of",
        ),
        (
            "Join",
            pb.JoinRequest(
                group="long",
                world_size=1,
                device="cpu",
                pid=1,
                overrides=[pb.Boundary(name=LONG)],
                geometry=pb.Geometry(capacity_bytes=4096, dtypes=[pb.FLOAT32]),
            ),
            "INVALID_ARGUMENT",
            "at most once for a CPU group",
        ),  # fmt: skip
    ],
)
def test_a_long_value_in_a_request_gets_a_short_answer(checked, method, request_, code, expected):
    # A status message past the client's metadata limit reached the rank as RESOURCE_EXHAUSTED
    # "received metadata size exceeds hard limit", without the daemon's answer.
    error = refused(checked, method, request_)
    assert error.code().name == code and expected in error.details(), error
    assert len(error.details().encode()) <= 1100


def test_a_long_device_kind_to_calibrate_gets_a_short_answer(checked):
    with pytest.raises(grpc.RpcError) as raised:
        request = pb.CalibrateRequest(device_kind=LONG)
        list(checked.stub.Calibrate(request, timeout=5))
    error = raised.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "expected 'cpu' or 'cuda'" in error.details()
    assert len(error.details().encode()) <= 1100
    checked.assert_alive()


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0, 0.0])
def test_a_topk_exchange_with_any_timeout_opens(checked, timeout):
    # Found by test_open_topk_exchange: timeout_seconds NaN reached asyncio.wait_for -> UNKNOWN
    # "cannot convert float NaN to integer" (after the exchange's slabs were allocated).
    stub = checked.stub
    reply = stub.Join(join_request(f"xchg{timeout}", 0, 1, capacity=4096), timeout=5)
    session = SessionStream(stub, reply.group_id, 0)
    ids = dict(group=f"xchg{timeout}", group_id=reply.group_id, rank=0)
    try:
        request = pb.TopkExchangeRequest(**ids, max_rows=4, topk=2, layout_version=1, timeout_seconds=timeout)
        exchange = stub.OpenTopkExchange(request, timeout=5)
        assert [s.owner_rank for s in exchange.slabs] == [0]
    finally:
        stub.Leave(pb.LeaveRequest(**ids), timeout=5)
        session.close()
    checked.assert_alive()


def test_a_topk_stage_of_more_rows_than_fit_in_an_int64_is_invalid(checked):
    # Found by test_submit: len(range) of the owned rows overflowed -> UNKNOWN "Python int too
    # large to convert to C ssize_t".
    stub = checked.stub
    reply = stub.Join(join_request("rows", 0, 1, capacity=4096), timeout=5)
    session = SessionStream(stub, reply.group_id, 0)
    ids = dict(group="rows", group_id=reply.group_id, rank=0)
    try:
        allocation = stub.AllocateMemory(pb.AllocateMemoryRequest(**ids, size_bytes=4096), timeout=5)
        ref = pb.MemoryRef(allocation_id=allocation.allocation_id)
        request = pb.SubmitRequest(
            **ids, op=pb.TOPK_STAGE, count=2**64 - 1, topk=2**31, input=ref, output=ref, timeout_seconds=1
        )
        error = refused(checked, "Submit", request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "run past allocation" in error.details(), error
    finally:
        stub.Leave(pb.LeaveRequest(**ids), timeout=5)
        session.close()


def _pair(checked: Checked, name: str) -> tuple[dict[int, dict], list[SessionStream]]:
    """A formed world-2 group of raw joins (both ranks this process), its sessions open."""
    replies: dict[int, pb.JoinReply] = {}

    def join(rank: int) -> None:
        replies[rank] = checked.stub.Join(join_request(name, rank, 2, capacity=4096), timeout=5)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    group_id = replies[0].group_id
    return {r: dict(group=name, group_id=group_id, rank=r) for r in (0, 1)}, [
        SessionStream(checked.stub, group_id, r) for r in (0, 1)
    ]


def _leave_pair(checked: Checked, ids: dict[int, dict], sessions: list[SessionStream]) -> None:
    for rank in (0, 1):
        checked.stub.Leave(pb.LeaveRequest(**ids[rank]), timeout=5)
    for session in sessions:
        session.close()


@pytest.mark.parametrize("op, topk", [(pb.ALL_GATHER, 0), (pb.TOPK_STAGE, 1)])
def test_an_all_gather_or_topk_stage_in_place_is_refused_for_every_rank(checked, op, topk):
    # Found by test_both_ranks_of_a_pair_submit_at_once: rank 1's all_gather with its input at its
    # output's offset ran, and rank 0's part overwrote rank 1's input before it was copied: rank 1
    # (and any rank after it) got rank 0's bytes in rank 1's slot.
    stub = checked.stub
    ids, sessions = _pair(checked, f"inplace{op}")
    try:
        refs = {}
        for rank in (0, 1):
            allocation = stub.AllocateMemory(pb.AllocateMemoryRequest(**ids[rank], size_bytes=4096), timeout=5)
            refs[rank] = allocation.allocation_id
        requests = [
            pb.SubmitRequest(
                **ids[rank], op=op, count=64, topk=topk, timeout_seconds=5,
                input=pb.MemoryRef(allocation_id=refs[rank], offset_bytes=0),
                output=pb.MemoryRef(allocation_id=refs[rank], offset_bytes=0 if rank == 1 else 1024),
            )
            for rank in (0, 1)
        ]  # fmt: skip
        futures = [stub.Submit.future(request, timeout=10) for request in requests]
        for future in futures:
            error = future.exception()
            assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
            assert "input and output overlap; expected disjoint ranges" in error.details(), error.details()
    finally:
        _leave_pair(checked, ids, sessions)
    checked.assert_alive()


def test_a_topk_exchange_whose_caller_goes_away_fails_for_every_rank(checked):
    # Found reading open_topk_exchange beside Submit's fix: a cancelled open left its arrival, so
    # the peer's open formed the exchange and allocated slabs with a token for no one, and the
    # cancelled rank's retry got ALREADY_EXISTS "already opened".
    stub = checked.stub
    ids, sessions = _pair(checked, "xcancel")
    try:
        request = {
            rank: pb.TopkExchangeRequest(**ids[rank], max_rows=4, topk=2, layout_version=1, timeout_seconds=5)
            for rank in (0, 1)
        }
        handled = handled_calls(checked.daemon, "OpenTopkExchange")
        assert refused(checked, "OpenTopkExchange", request[0], timeout=0.2).code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for_the_call_given_up(checked.daemon, "OpenTopkExchange", handled)
        for rank in (1, 0):
            error = refused(checked, "OpenTopkExchange", request[rank])
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
            assert "rank 0 stopped waiting for it" in error.details() and "nothing was allocated" in error.details()
        groups = {g.name: g for g in stub.ListGroups(pb.ListGroupsRequest(), timeout=5).groups}
        assert groups["xcancel"].topk_exchanges == 0
        # The next exchange, which both ranks open, forms.
        following = [
            pb.TopkExchangeRequest(**ids[rank], sequence=1, max_rows=4, topk=2, layout_version=1, timeout_seconds=5)
            for rank in (0, 1)
        ]
        futures = [stub.OpenTopkExchange.future(r, timeout=10) for r in following]
        assert [len(f.result().slabs) for f in futures] == [2, 2]
    finally:
        _leave_pair(checked, ids, sessions)
    checked.assert_alive()


def _memfds_named(pid: int, text: str) -> list[str]:
    """The daemon's descriptors and mappings of memfds whose name holds `text`."""
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass  # closed meanwhile
    with open(f"/proc/{pid}/maps") as maps:
        held.extend(line.split()[-2] for line in maps if "memfd:" in line)
    return [name for name in held if text in name]


def test_a_submit_whose_caller_goes_away_releases_its_part(fuzz_daemon, checked):
    # Found while fuzzing Submit with gRPC deadlines shorter than its timeout: the cancelled call
    # left its part queued, so the sequence never ran or failed (a retry got ALREADY_EXISTS "already
    # submitted") and its allocation stayed mapped and open after FreeMemory and the group's release.
    stub = checked.stub
    reply = stub.Join(join_request("cancel", 0, 1, capacity=4096), timeout=5)
    session = SessionStream(stub, reply.group_id, 0)
    ids = dict(group="cancel", group_id=reply.group_id, rank=0)
    allocation = stub.AllocateMemory(pb.AllocateMemoryRequest(**ids, size_bytes=4096), timeout=5)
    ref = pb.MemoryRef(allocation_id=allocation.allocation_id)
    # Sequence 1 waits for sequence 0, which never comes; the caller gives up first.
    request = pb.SubmitRequest(
        **ids, sequence=1, op=pb.ALL_REDUCE, dtype=pb.FLOAT32, count=4, input=ref, output=ref, timeout_seconds=5
    )
    handled = handled_calls(fuzz_daemon, "Submit")
    assert refused(checked, "Submit", request, timeout=0.2).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for_the_call_given_up(fuzz_daemon, "Submit", handled)
    again = refused(checked, "Submit", request)
    assert again.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "rank 0 stopped waiting for it" in again.details()
    stub.FreeMemory(pb.FreeMemoryRequest(**ids, allocation_id=allocation.allocation_id), timeout=5)
    stub.Leave(pb.LeaveRequest(**ids), timeout=5)
    session.close()
    pid = fuzz_daemon.process.pid
    wait_until(lambda: not _memfds_named(pid, "nodecomm:cancel:"), 5, "the group's memfds closed and unmapped")
    checked.assert_alive()


def test_a_claim_behind_a_burst_of_connections_is_served(fuzz_daemon, checked):
    # Found by test_garbage's many connections at once: the descriptor socket listened with a
    # backlog of 128, so past 128 pending connections a rank's claim failed at once with EAGAIN
    # ("Resource temporarily unavailable") instead of waiting its turn.
    stub = checked.stub
    reply = stub.Join(join_request("burst", 0, 1, capacity=4096), timeout=5)
    session = SessionStream(stub, reply.group_id, 0)
    ids = dict(group="burst", group_id=reply.group_id, rank=0)
    held: list[socket.socket] = []
    try:
        for _ in range(600):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.append(sock)
            sock.settimeout(5)
            sock.connect(fuzz_daemon.descriptor_socket)  # and says nothing
        fds = claim_descriptors(fuzz_daemon.descriptor_socket, reply.claim_token, 4, 10.0)
        assert len(fds) == 2  # the control segment and the one rank's buffer
        for fd in fds:
            os.close(fd)
    finally:
        for sock in held:
            sock.close()
        stub.Leave(pb.LeaveRequest(**ids), timeout=5)
        session.close()
    checked.assert_alive()


def test_request_bytes_that_do_not_parse_are_invalid_not_unknown(checked):
    # Found by test_bytes_that_are_not_a_request: gRPC's generated deserializer raised DecodeError,
    # answered UNKNOWN "Unexpected <class 'DecodeError'>" and logged a traceback for each call.
    channel = checked.channel
    for method in ("Join", "Submit", "ListGroups"):
        with pytest.raises(grpc.RpcError) as raised:
            channel.unary_unary(f"/nodecomm.v1.Control/{method}")(b"\xff\xff\xff", timeout=5)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
        assert f"are not a valid nodecomm.v1.{method}" in raised.value.details()
    with pytest.raises(grpc.RpcError) as raised:
        list(channel.unary_stream("/nodecomm.v1.Control/Calibrate")(b"\xff", timeout=5))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
    # Mid-stream on a live session: the stream ends with the reason, and the rank is lost.
    reply = checked.stub.Join(join_request("undecodable", 0, 1, capacity=4096), timeout=5)
    hello = pb.SessionUp(hello=pb.SessionHello(group_id=reply.group_id, rank=0)).SerializeToString()
    with pytest.raises(grpc.RpcError) as raised:
        session = channel.stream_stream("/nodecomm.v1.Control/Session")
        list(session(iter([hello, b"\xff\xff"]), timeout=5, metadata=rank_metadata(reply.rank_secret)))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nodecomm.v1.SessionUp" in raised.value.details()
    groups = checked.stub.ListGroups(pb.ListGroupsRequest(), timeout=5).groups
    assert reply.group_id not in [g.group_id for g in groups if g.state == "active"]
    checked.assert_alive()
