"""Join: agreement before allocation, and bad requests answered with a clear status."""

import socket

import grpc
import pytest

import nodecomm
import ranks
from conftest import join_request, reserved_bytes, stub_for
from nodecomm import _native
from nodecomm.v1 import control_pb2 as pb
from waiting import wait_until


@pytest.mark.parametrize(
    "field, per_rank",
    [
        ("world_size", [{"world": 2}, {"world": 3}]),
        ("dtypes", [{}, {"dtypes": ("float32", "bfloat16")}]),
        ("capacity_bytes", [{}, {"capacity_bytes": 1 << 20}]),
        ("overrides", [{}, {"thresholds": {"oneshot_max_bytes": "8KiB"}}]),
        ("wire", [{}, {"wire": "int8"}]),
    ],
)
def test_mismatch_fails_every_rank_before_allocation(daemon, spawn_ranks, field, per_rank):
    group = spawn_ranks(_mismatched_join, 2, daemon.socket, per_rank, timeout=60)
    results = group.results()
    for rank, (status, value) in results.items():
        assert status == "error", (rank, value)
        name, message, _ = value
        assert name == "GroupMismatchError", message
        assert f"disagree on {field}" in message and "rank 0 has" in message and "rank 1 has" in message
    assert reserved_bytes(daemon) == 0
    assert 'nodecomm_groups{state="joining"} 0.0' in daemon.metrics_text()


def _mismatched_join(rank, socket_path, per_rank):
    options = dict(per_rank[rank])
    world = options.pop("world", 2)
    return ranks.join_only(rank, world, socket_path, "mismatch", options)


def test_last_rank_mismatch_fails_the_waiting_ranks_too(daemon, spawn_ranks):
    group = spawn_ranks(_third_differs, 3, daemon.socket, timeout=60)
    for rank, (status, value) in group.results().items():
        assert status == "error" and value[0] == "GroupMismatchError", (rank, value)
        assert "rank 2 has 2097152" in value[1]


def _third_differs(rank, socket_path):
    if rank == 2:
        ranks.wait_joined(socket_path, "late", [0, 1])  # arrives last
    return ranks.join_only(rank, 3, socket_path, "late", {"capacity_bytes": (2 << 20) if rank == 2 else (1 << 20)})


def test_join_deadline_names_who_came_who_gave_up_and_who_never_came(daemon):
    """Of 3 ranks, rank 1 joins with a 3 s deadline; rank 0 joins with 1 s and gives up: its error
    says it waited and rank 1 is there; rank 1's then says rank 0 came and gave up and rank 2
    never came."""
    channel, stub = stub_for(daemon)
    with channel:
        waiting = stub.Join.future(join_request(group="lonely", rank=1, world_size=3, timeout=3.0), timeout=10)
        ranks.wait_joined(daemon.socket, "lonely", [1])
        with pytest.raises(grpc.RpcError) as raised:
            stub.Join(join_request(group="lonely", rank=0, world_size=3, timeout=1.0), timeout=10)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "rank 0 waited 1.0 s: ranks [0, 1] joined; ranks [2] never joined" in raised.value.details()
        with pytest.raises(grpc.RpcError) as raised:
            waiting.result()
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert raised.value.details().endswith(
        "rank 1 waited 3.0 s: ranks [1] joined; ranks [0] joined but gave up before the others came; ranks [2] "
        "never joined; nothing was allocated"
    ), raised.value.details()


@pytest.mark.parametrize(
    "request_kwargs, code, text",
    [
        ({"world_size": -1}, grpc.StatusCode.INVALID_ARGUMENT, "world_size -1: expected 1..16"),
        ({"world_size": 0}, grpc.StatusCode.INVALID_ARGUMENT, "world_size 0"),
        ({"world_size": 17}, grpc.StatusCode.INVALID_ARGUMENT, "expected 1..16"),
        pytest.param(
            {"world_size": 9, "device": "GPU-00000000-0000-0000-0000-000000000000"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "world_size 9: a CUDA group takes 1-8 or 16 ranks (the sizes its kernels are built for)",
            marks=pytest.mark.skipif(not _native.WITH_CUDA, reason="a CPU-only build"),
            id="cuda-world-9",
        ),
        ({"rank": 2, "world_size": 2}, grpc.StatusCode.INVALID_ARGUMENT, "rank 2: expected 0..1"),
        ({"rank": -3}, grpc.StatusCode.INVALID_ARGUMENT, "rank -3"),
        ({"group": ""}, grpc.StatusCode.INVALID_ARGUMENT, "group name ''"),
        ({"group": "x" * 5000}, grpc.StatusCode.INVALID_ARGUMENT, "expected 1-128 characters"),
        ({"group": "a b\x00"}, grpc.StatusCode.INVALID_ARGUMENT, "group name"),
        ({"capacity": 0}, grpc.StatusCode.INVALID_ARGUMENT, "capacity_bytes 0"),
        ({"capacity": 1 << 40}, grpc.StatusCode.RESOURCE_EXHAUSTED, "max_capacity_bytes"),
        ({"dtypes": ()}, grpc.StatusCode.INVALID_ARGUMENT, "geometry.dtypes"),
        ({"dtypes": (42,)}, grpc.StatusCode.INVALID_ARGUMENT, "geometry.dtypes [42]"),
        ({"pid": -5}, grpc.StatusCode.INVALID_ARGUMENT, "pid -5"),
        ({"device": "cuda:0"}, grpc.StatusCode.INVALID_ARGUMENT, "expected 'cpu' or the UUID of a GPU"),
        ({"device": "GPU-00000000-0000-0000-0000-000000000000"}, grpc.StatusCode.INVALID_ARGUMENT, "GPU"),
        ({"nccl": True}, grpc.StatusCode.INVALID_ARGUMENT, "nccl_fallback applies to CUDA groups"),
        ({"wire": 7}, grpc.StatusCode.INVALID_ARGUMENT, "geometry.wire 7: expected lossless, int8 or fp8"),
    ],
)
def test_bad_join_requests(daemon, request_kwargs, code, text):
    channel, stub = stub_for(daemon)
    with channel:
        with pytest.raises(grpc.RpcError) as raised:
            stub.Join(join_request(**request_kwargs), timeout=10)
        assert raised.value.code() == code
        assert text in raised.value.details()
        assert stub.ListGroups(pb.ListGroupsRequest(), timeout=5).groups == []


def test_duplicate_rank_is_refused_and_the_first_keeps_waiting(daemon):
    channel, stub = stub_for(daemon)
    with channel:
        first = stub.Join.future(join_request(group="dup", timeout=3.0), timeout=10)
        ranks.wait_joined(daemon.socket, "dup", [0])
        with pytest.raises(grpc.RpcError) as raised:
            stub.Join(join_request(group="dup"), timeout=10)
        assert raised.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "rank 0 is already joining" in raised.value.details()
        groups = stub.ListGroups(pb.ListGroupsRequest(), timeout=5).groups
        assert [(g.name, g.state, list(g.joined_ranks)) for g in groups] == [("dup", "joining", [0])]
        with pytest.raises(grpc.RpcError) as waited:
            first.result()
        assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_leave_unknown_group(daemon):
    channel, stub = stub_for(daemon)
    with channel, pytest.raises(grpc.RpcError) as raised:
        stub.Leave(pb.LeaveRequest(group="nope", group_id=123, rank=0), timeout=5)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no group named 'nope'" in raised.value.details()


def test_session_must_start_with_hello(daemon):
    channel, stub = stub_for(daemon)
    with channel, pytest.raises(grpc.RpcError) as raised:
        list(stub.Session(iter([pb.SessionUp(timings=pb.TimingBatch())]), timeout=5))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_unknown_claim_token_and_garbage_on_both_sockets(daemon, spawn_ranks):
    from nodecomm.client.descriptors import claim_descriptors

    with pytest.raises(PermissionError, match="unknown, already used or expired"):
        claim_descriptors(daemon.descriptor_socket, b"\x00" * 16, 8, 5.0)
    for path in (daemon.socket, daemon.descriptor_socket):
        for payload in (b"\x00" * 3, b"GET / HTTP/1.1\r\n\r\n", bytes(range(256)) * 64):
            with socket.socket(socket.AF_UNIX) as raw:
                raw.settimeout(5)
                raw.connect(path)
                raw.sendall(payload)
                try:
                    raw.recv(4096)
                except (TimeoutError, OSError):
                    pass
    assert daemon.healthy()
    assert spawn_ranks(ranks.join_only, 2, 2, daemon.socket, "after-garbage", {}).values() == {
        0: "ok [2.0, 2.0, 2.0, 2.0]",
        1: "ok [2.0, 2.0, 2.0, 2.0]",
    }


def test_claim_from_another_process_is_refused(daemon):
    """A token is bound to the pid that joined: presenting it from elsewhere fails."""
    from nodecomm.client.descriptors import claim_descriptors

    channel, stub = stub_for(daemon)
    with channel:
        reply = stub.Join(join_request(group="solo", world_size=1, pid=1), timeout=10)
    with pytest.raises(PermissionError, match="issued to pid 1"):
        claim_descriptors(reply.descriptor_socket, reply.claim_token, 8, 5.0)


@pytest.mark.parametrize(
    "device, text",
    [
        ("tpu:0", "expected 'cpu', 'cuda' or 'cuda:N'"),
        ("not a device", "expected 'cpu', 'cuda' or 'cuda:N'"),
        ("cuda:99", "device 'cuda:99'"),
    ],
)
def test_connect_refuses_devices_it_cannot_serve(daemon, device, text):
    import nodecomm

    with pytest.raises(nodecomm.InvalidArgumentError, match=text):
        nodecomm.connect("dev", 0, 1, device=device, socket=daemon.socket, timeout=5)
    with pytest.raises(nodecomm.InvalidArgumentError, match="a CPU group has no NCCL path"):
        nodecomm.connect("dev", 0, 1, socket=daemon.socket, timeout=5, nccl_group=object())


def test_peer_checks_apply_to_cuda_groups_only(daemon):
    channel, stub = stub_for(daemon)
    with channel:
        reply = stub.Join(join_request(group="host", world_size=1), timeout=10)
        with pytest.raises(grpc.RpcError) as raised:
            report = pb.PeerCheckReport(group="host", group_id=reply.group_id, rank=0, ok=True, stage=1)
            stub.CheckPeers(report, timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "peer checks apply to CUDA groups" in raised.value.details()


def test_group_overrides_win_over_the_daemons(make_daemon, spawn_ranks):
    daemon = make_daemon(env={"NODECOMM_ONESHOT_MAX_BYTES": "off"})
    tables = spawn_ranks(ranks.table_with, 2, 2, daemon.socket, {"oneshot_max_bytes": " 4 kib "}).values()
    assert tables == {r: [(0, 4096, "oneshot"), (4097, None, "twoshot")] for r in range(2)}
    assert "oneshot_max_bytes=4KiB (override)" in daemon.log()  # the table in force, in the log


@pytest.mark.parametrize(
    "thresholds, text",
    [
        (
            {"dma_min_bytes": "1MiB"},
            "expected each of ['compressed_min_bytes', 'oneshot_max_bytes', 'service_min_bytes'] at most once for a CPU group",
        ),
        ({"oneshot_max_bytes": "-5"}, "thresholds['oneshot_max_bytes']"),
    ],
)
def test_bad_group_overrides(daemon, thresholds, text):
    import nodecomm

    with pytest.raises(nodecomm.InvalidArgumentError) as raised:
        nodecomm.connect("bad-overrides", 0, 1, socket=daemon.socket, timeout=5, thresholds=thresholds)
    assert text in str(raised.value)


def test_a_client_laying_out_more_than_the_daemon_gave_refuses_it(daemon, spawn_ranks):
    """A client whose buffer layout outgrew the daemon's (another nodecomm version) must not map
    buffers its peers would write past; the group is released and forms again with matching sides."""
    group = spawn_ranks(_join_with_a_larger_layout, 2, daemon.socket, timeout=60)
    for rank, (status, value) in group.results().items():
        assert status == "error", (rank, value)
        name, message, _ = value
        assert name == "DaemonUnavailableError", message
        assert "different versions of nodecomm" in message and "smaller than the" in message
    # A connect that fails after Join leaves at once: the bound shows it was not the 10 s session
    # grace that released the group.
    wait_until(lambda: reserved_bytes(daemon) == 0, 5, "the failed connects' group released before the session grace")
    again = spawn_ranks(ranks.join_only, 2, 2, daemon.socket, "layout", {}, timeout=60)
    assert again.values() == {0: "ok [2.0, 2.0, 2.0, 2.0]", 1: "ok [2.0, 2.0, 2.0, 2.0]"}


def _join_with_a_larger_layout(rank, socket_path):
    from nodecomm import _native

    laid_out = _native.shm_buffer_bytes
    _native.shm_buffer_bytes = lambda capacity_bytes: laid_out(capacity_bytes) + 4096
    return ranks.join_only(rank, 2, socket_path, "layout", {})


@pytest.mark.parametrize(
    "arguments, text",
    [
        ({"group": "a b"}, "group name 'a b': expected 1-128 characters"),
        ({"rank": 2}, "rank 2: expected 0..1 for world_size 2"),
        ({"rank": "0"}, "rank '0': expected an int"),
        ({"world_size": 17}, "world_size 17: expected 1..16"),
        ({"capacity_bytes": 8}, "geometry.capacity_bytes 8: expected at least 64"),
        ({"dtypes": ()}, "geometry.dtypes []: expected one or more of"),
        ({"wire": "int4"}, "wire 'int4': expected one of lossless, int8, fp8"),
        ({"timeout": 0}, "timeout 0: expected a positive number of seconds"),
    ],
)
def test_connect_checks_its_arguments_before_it_dials_a_daemon(tmp_path, arguments, text):
    """The checks the daemon runs on a Join (nodecomm.join_rules) run in connect() first: with no
    daemon at the socket, a bad argument is what the caller hears, not the missing daemon."""
    import nodecomm
    from nodecomm.errors import InvalidArgumentError

    call = {"group": "g", "rank": 0, "world_size": 2, "socket": str(tmp_path / "none.sock"), "timeout": 2.0}
    with pytest.raises(InvalidArgumentError) as raised:
        nodecomm.connect(**{**call, **arguments})
    assert text in str(raised.value), str(raised.value)


def test_peer_processes_are_checked_before_joining(daemon):
    """connect(peer_processes=): other ranks of the group mapped to (pid, start time)."""
    from nodecomm.client.peer_liveness import process_running, this_process

    assert process_running(this_process()) and not process_running((this_process()[0], this_process()[1] + 1))
    for bad in ({0: (1, 1)}, {5: (1, 1)}, {1: (1,)}, {1: "pid"}):
        with pytest.raises(nodecomm.InvalidArgumentError, match="peer_processes .*expected another rank of 0..1"):
            nodecomm.connect("watched", 0, 2, socket=daemon.socket, timeout=5, peer_processes=bad)
