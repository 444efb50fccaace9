"""Access control: socket modes and group, who may join (SO_PEERCRED against allowed uids and
groups, through identities the descriptor socket issues), TCP beyond loopback only with TLS, and
the per-daemon quotas."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import tempfile
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import nodecomm
from conftest import Daemon, as_user, free_port, join_request, self_signed, stub_for
from nodecomm.client.daemon_process import daemon_command

from .harness import FIGURES

NOBODY = 65534  # uid nobody, gid nogroup on Debian


def _checked(case: str) -> None:
    FIGURES.access.append(case)


@pytest.fixture
def open_directory():
    """A directory every user can traverse (pytest's own are 0700), for sockets others must reach."""
    directory = Path(tempfile.mkdtemp(prefix="nodecomm-access-"))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class SocketDaemon(Daemon):
    """A daemon whose socket sits in a directory it creates itself (run/)."""

    @property
    def socket(self) -> str:
        return str(self.directory / "run" / "nodecomm.sock")


def identify_as(uid: int, gid: int, path: str) -> bytes:
    """What the descriptor socket answers IDENTIFY from a process running as uid/gid."""
    return as_user(uid, gid, "identify", path)


@pytest.mark.skipif(os.geteuid() != 0, reason="changes uids and socket groups: needs root (CI runs as root)")
def test_sockets_are_private_to_their_group(open_directory):
    daemon = SocketDaemon(open_directory, ["--socket-group", "nogroup"]).start()
    try:
        run = Path(daemon.socket).parent
        for path, mode in ((run, 0o750), (Path(daemon.socket), 0o660), (Path(daemon.descriptor_socket), 0o660)):
            info = path.stat()
            assert stat.S_IMODE(info.st_mode) == mode and info.st_gid == NOBODY, (path, oct(info.st_mode), info.st_gid)
        # A member of the group reaches the descriptor socket; anyone else is stopped by the mode.
        assert identify_as(NOBODY, NOBODY, daemon.descriptor_socket)[:1] == b"\x00"
        assert identify_as(4242, 4242, daemon.descriptor_socket)[:1] == b"\x03"  # EACCES on connect
    finally:
        daemon.stop(signal.SIGKILL)
    _checked("socket modes and group")


@pytest.mark.skipif(os.geteuid() != 0, reason="changes uids: needs root (CI runs as root)")
def test_only_admitted_callers_join(open_directory):
    daemon = SocketDaemon(open_directory, ["--socket-group", "nogroup", "--allowed-uids", "4242"]).start()
    try:
        refused = identify_as(NOBODY, NOBODY, daemon.descriptor_socket)
        assert refused[:1] == b"\x01" and b"uid 65534" in refused and b"may not use this daemon" in refused
        # The control socket closes a connection from a uid it does not admit as it arrives, saying why.
        answer = as_user(NOBODY, NOBODY, "health", daemon.socket).decode()
        assert answer.startswith("PERMISSION_DENIED") and "uid 65534 (nobody) may not use this daemon" in answer, answer
        channel, stub = stub_for(daemon)
        with channel:
            # The daemon's own uid is admitted; connect() identifies itself on its own.
            with nodecomm.connect("admitted", 0, 1, socket=daemon.socket, timeout=10) as comm:
                assert comm.all_reduce(torch.ones(4)).tolist() == [1.0] * 4
            with nodecomm.connect("admitted", 0, 1, socket=f"unix:{daemon.socket}", timeout=10) as comm:
                assert comm.all_reduce(torch.ones(4)).tolist() == [1.0] * 4  # a gRPC target finds it too
            # An identity works once, and only for the process it was issued to.
            token = identify_as(0, 0, daemon.descriptor_socket)[1:]  # issued to a forked child
            for attempt in range(2):
                request = join_request(group="raw", world_size=1)
                request.identity = token
                with pytest.raises(grpc.RpcError) as denied:
                    stub.Join(request, timeout=10)
                expected = "was issued to pid" if attempt == 0 else "unknown, already used or expired"
                assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED and expected in denied.value.details()
    finally:
        daemon.stop(signal.SIGKILL)
    daemon = SocketDaemon(open_directory / "again", ["--socket-group", "nogroup", "--allowed-gids", "nogroup"])
    (open_directory / "again").mkdir()
    daemon.start()
    try:
        assert identify_as(NOBODY, NOBODY, daemon.descriptor_socket)[:1] == b"\x00"  # a member of an allowed group
        assert as_user(NOBODY, NOBODY, "health", daemon.socket) == b"SERVING"
    finally:
        daemon.stop(signal.SIGKILL)
    _checked("admission by uid and group")


def test_tcp_beyond_loopback_needs_tls(tmp_path):
    port = free_port()
    refused = subprocess.run(
        daemon_command(str(tmp_path / "a.sock"), "--tcp-address", f"0.0.0.0:{port}", "--metrics-address", "off"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "tls_cert and tls_key for any other" in refused.stderr

    cert, key = self_signed(tmp_path)
    daemon = Daemon(tmp_path, ["--tcp-address", f"0.0.0.0:{port}", "--tls-cert", str(cert), "--tls-key", str(key)])
    daemon.start()
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # plaintext gets nowhere
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        daemon.stop(signal.SIGKILL)
    _checked("TCP needs TLS beyond loopback")


def test_quotas(make_daemon):
    daemon = make_daemon("--max-groups", "1", "--max-ranks-per-group", "2", "--join-timeout-seconds", "5")
    channel, stub = stub_for(daemon)
    with channel:
        with pytest.raises(grpc.RpcError) as refused:
            stub.Join(join_request(group="wide", world_size=3), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_ranks_per_group 2" in refused.value.details()
        first = stub.Join.future(join_request(group="one", world_size=2, timeout=5), timeout=10)  # forming
        with pytest.raises(grpc.RpcError) as refused:
            stub.Join(join_request(group="two", world_size=1), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_groups" in refused.value.details()
        with pytest.raises(grpc.RpcError):
            first.result()  # rank 1 never came
        # The forming group is gone: the quota has room again.
        assert stub.Join(join_request(group="two", world_size=1), timeout=10).group_id
    _checked("quotas")


def test_only_the_joined_process_acts_as_its_rank(daemon):
    from nodecomm.credentials import rank_metadata
    from nodecomm.socket_path import grpc_target
    from nodecomm.v1 import control_pb2 as pb
    from nodecomm.v1 import control_pb2_grpc as pb_grpc

    with grpc.insecure_channel(grpc_target(daemon.socket)) as channel:  # no secrets added for us
        stub = pb_grpc.ControlStub(channel)
        reply = stub.Join(join_request(group="mine", world_size=1), timeout=10)
        ids = dict(group="mine", group_id=reply.group_id, rank=0)
        assert len(reply.rank_secret) == 16
        calls = {
            "Leave": lambda md: stub.Leave(pb.LeaveRequest(**ids), timeout=5, metadata=md),
            "AllocateMemory": lambda md: stub.AllocateMemory(pb.AllocateMemoryRequest(**ids, size_bytes=64), timeout=5, metadata=md),
            "Session": lambda md: next(
                stub.Session(iter([pb.SessionUp(hello=pb.SessionHello(group_id=reply.group_id, rank=0))]), timeout=5, metadata=md)
            ),
        }  # fmt: skip
        for name, call in calls.items():
            for metadata, what in ((None, "missing"), (rank_metadata(b"x" * 16), "wrong")):
                with pytest.raises(grpc.RpcError) as denied:
                    call(metadata)
                assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
                assert (
                    f"does not hold rank 0's membership: the rank secret from its Join is {what}"
                    in denied.value.details()
                )
        stub.Leave(pb.LeaveRequest(**ids), timeout=5, metadata=rank_metadata(reply.rank_secret))  # the rank itself
    _checked("only the joined process acts as its rank")
