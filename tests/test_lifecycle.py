"""Group memory and claim tokens are released on every path; limits hold; sockets are not stolen."""

import os
import socket
import subprocess

import grpc
import pytest

import ranks
from conftest import join_request, rank_channel, reserved_bytes
from nodecomm.client.daemon_process import daemon_command
from nodecomm.client.descriptors import DescriptorSocket, claim_descriptors
from nodecomm.socket_path import descriptor_socket_path, grpc_target
from nodecomm.trust import node_daemon_uids
from nodecomm.v1 import control_pb2 as pb
from nodecomm.v1 import control_pb2_grpc as pb_grpc
from waiting import wait_until


def test_ranks_that_never_open_a_session_are_released_with_their_tokens(make_daemon):
    daemon = make_daemon("--session-grace-seconds", "1")
    with rank_channel(daemon.socket) as channel:
        stub = pb_grpc.ControlStub(channel)
        first = stub.Join.future(join_request(group="ghost", rank=0), timeout=10)
        second = stub.Join(join_request(group="ghost", rank=1), timeout=10)
        first = first.result()
        assert reserved_bytes(daemon) > 0
        # Rank 0 claims and maps nothing more; neither rank opens its session. Rank 0 leaves.
        stub.Leave(pb.LeaveRequest(group="ghost", group_id=first.group_id, rank=0), timeout=5)
        wait_until(lambda: reserved_bytes(daemon) == 0, 10, "the group's release")
        assert stub.ListGroups(pb.ListGroupsRequest(), timeout=5).groups == []
    with pytest.raises(PermissionError, match="unknown, already used or expired"):
        claim_descriptors(second.descriptor_socket, second.claim_token, 8, 5.0)
    assert "did not open its session" in daemon.log()


def test_reserved_memory_quota(make_daemon):
    daemon = make_daemon("--max-reserved-bytes", "4MiB")
    with grpc.insecure_channel(grpc_target(daemon.socket)) as channel:
        stub = pb_grpc.ControlStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Join(join_request(group="big", world_size=1, capacity=4 << 20), timeout=10)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_reserved_bytes 4194304" in raised.value.details()
        assert stub.ListGroups(pb.ListGroupsRequest(), timeout=5).groups == []
    assert reserved_bytes(daemon) == 0


def test_join_timeout_is_capped_by_the_daemon(make_daemon):
    daemon = make_daemon("--join-timeout-seconds", "1")
    with grpc.insecure_channel(grpc_target(daemon.socket)) as channel, pytest.raises(grpc.RpcError) as raised:
        pb_grpc.ControlStub(channel).Join(join_request(group="patient", timeout=float("inf")), timeout=30)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "rank 0 waited 1.0 s" in raised.value.details(), raised.value.details()  # the daemon's cap, not inf


def test_a_live_socket_is_not_taken_over(daemon, tmp_path):
    state = tmp_path / "second-state"
    second = subprocess.run(
        daemon_command(daemon.socket, "--metrics-address", "off", "--state-dir", str(state)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 2
    assert "another process is serving on this socket" in second.stderr
    assert daemon.healthy()
    assert not state.exists(), "a daemon that did not serve made its state directory (and adoption key)"


def test_a_silent_descriptor_client_delays_nobody(daemon, spawn_ranks):
    descriptors = descriptor_socket_path(daemon.socket)
    with socket.socket(socket.AF_UNIX) as silent:
        silent.connect(descriptors)  # sends nothing
        token = DescriptorSocket(descriptors, node_daemon_uids(descriptors)).identify(5.0, {})
        assert len(token) == 16
        # answered while the silent connection is still open: the daemon did not wait it out
        with pytest.raises(BlockingIOError):
            silent.recv(1, socket.MSG_DONTWAIT)
        results = spawn_ranks(ranks.join_only, 2, 2, daemon.socket, "beside-silent", {}).values()
        assert set(results.values()) == {"ok [2.0, 2.0, 2.0, 2.0]"}
    assert os.path.exists(descriptors)


def test_a_closed_communicator_accepts_nothing_and_a_bad_size_is_named(daemon):
    import pytest
    import torch

    import nodecomm

    comm = nodecomm.connect("closing", 0, 1, socket=daemon.socket, timeout=20)
    with pytest.raises(nodecomm.InvalidArgumentError, match="size_bytes -1: expected a whole number of bytes"):
        comm.service_buffer(-1)
    assert comm.accepts(torch.ones(4))
    comm.close()
    assert not comm.accepts(torch.ones(4))


def test_a_test_run_leaves_no_calibration_cache_behind(tmp_path):
    """The run's own cache directory (tests/conftest.py: no test touches the user's) goes with it."""
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests / "test_byte_size.py")],
        cwd=tests.parent, env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert list(tmp_path.glob("nodecomm-test-cache-*")) == []
