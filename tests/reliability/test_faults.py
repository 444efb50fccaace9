"""Faults: a rank stopped or killed at each stage of a group's life, a daemon killed under active
groups (those on peer paths run on), a claim token never used, an allocation that fails half-way.
Every surviving rank gets an error that names what happened within its timeout, the daemon keeps
serving, and the name forms again."""

from __future__ import annotations

import multiprocessing as mp
import resource
import signal
import time
from pathlib import Path

import grpc
import pytest

import nodecomm
import restart_ranks
from conftest import Daemon, free_port, join_request, stub_for
from nodecomm.errors import ResourceExhaustedError
from nodecomm.v1 import control_pb2 as pb
from ranks import wait_joined
from waiting import wait_until

from . import fault_ranks
from .harness import FIGURES
from .test_load import daemon_resources, settle

OPERATION_TIMEOUT = 3.0
SESSION_GRACE = 3.0
DAEMON_ARGS = [
    "--operation-timeout-seconds", str(OPERATION_TIMEOUT),
    "--join-timeout-seconds", "5",
    "--session-grace-seconds", str(SESSION_GRACE),
    "--claim-token-ttl-seconds", "2",
    "--log-level", "INFO",
]  # fmt: skip


@pytest.fixture(scope="module")
def fault_daemon(tmp_path_factory):
    daemon = Daemon(tmp_path_factory.mktemp("faults"), list(DAEMON_ARGS)).start()
    try:
        yield daemon
    finally:
        daemon.stop(signal.SIGKILL)


def _survived(fault: str) -> None:
    FIGURES.faults[fault] += 1


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["SIGSTOP", "SIGKILL"])
@pytest.mark.parametrize("stage", fault_ranks.STAGES)
def test_a_rank_stopped_or_killed_at_each_stage(fault_daemon, spawn_ranks, stage, sig):
    stop_or_kill_at(fault_daemon, spawn_ranks, stage, sig, "cpu")
    _survived(f"{sig.name} at {stage}")


def stop_or_kill_at(daemon: Daemon, spawn_ranks, stage: str, sig: signal.Signals, device: str) -> None:
    """Rank 1 of a pair working at `stage` on `device` gets `sig`: rank 0 must get an error naming
    it within its timeout, the daemon must stay healthy, and the group must form again."""
    context = mp.get_context("spawn")
    report, signalled = context.Queue(), context.Queue()
    group = f"fault-{device}-{stage}-{sig.name}"
    ranks = spawn_ranks(
        fault_ranks.work_until_error, 2, 2, daemon.socket, group, stage, report, signalled, device, timeout=180
    )
    # Each rank reports once a step of the stage's work is done; at "joining", rank 1 before it
    # never joins and rank 0 before its Join, which must be waiting in the daemon.
    assert {report.get(timeout=120)[1] for _ in range(2)} == {0, 1}
    if stage == "joining":
        wait_joined(daemon.socket, group, [0])
    ranks.kill(1, sig)
    signalled.put(time.time())
    status, value = ranks.results()[0] if sig == signal.SIGKILL else survivor_only(ranks)
    assert status == "ok", value
    name, message, waited = value
    assert name in ("PeerLostError", "DeadlineExceededError"), (name, message)
    assert "rank 1" in message or "ranks [1]" in message, message
    # The survivor waits at most its operation (or join) timeout, plus the time to notice.
    assert waited < 5.0 + OPERATION_TIMEOUT + 3.0, (waited, message)
    if sig == signal.SIGSTOP:
        ranks.kill(1, signal.SIGKILL)
    # The name forms again once the group is no longer active: the daemon has given the dead
    # rank's session its grace and aborted the group (released once every rank has left).
    channel, stub = stub_for(daemon)
    with channel:

        def active() -> bool:
            listed = stub.ListGroups(pb.ListGroupsRequest(), timeout=10).groups
            return any(info.name == group and info.state == "active" for info in listed)

        wait_until(lambda: not active(), SESSION_GRACE + OPERATION_TIMEOUT + 5.0, f"group {group!r} aborted")
    again = spawn_ranks(fault_ranks.reform, 2, 2, daemon.socket, group, device, timeout=120).values()
    assert again == {0: 3.0, 1: 3.0}
    assert daemon.healthy()


def survivor_only(ranks):
    """Rank 0's result: rank 1 is stopped, not gone, so the harness cannot wait for it."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rank, status, value = ranks.queue.get(timeout=max(0.1, deadline - time.monotonic()))
        if rank == 0:
            return status, value
    raise TimeoutError("rank 0 reported nothing")


def test_a_claim_token_never_used(fault_daemon):
    channel, stub = stub_for(fault_daemon)
    with channel:
        stub.ListGroups(pb.ListGroupsRequest(), timeout=10)  # this connection is part of the baseline
        before = daemon_resources(fault_daemon.process.pid)
        reply = stub.Join(join_request(group="unclaimed", world_size=1, timeout=5), timeout=10)
        assert reply.claim_token
        # No claim, no session: after the grace the rank is lost, the token expires, memory goes.
        after = settle(fault_daemon, fault_daemon.process.pid, before, timeout=20)
        assert after["fds"] <= before["fds"] and after["memfds"] <= before["memfds"], (before, after)
        reply = stub.Join(join_request(group="unclaimed", world_size=1, timeout=5), timeout=10)  # forms again
        assert reply.group_id
    assert "did not open its session" in fault_daemon.log()
    _survived("claim token never used")


def test_an_allocation_that_fails_half_way(tmp_path, spawn_ranks):
    daemon = Daemon(tmp_path, list(DAEMON_ARGS)).start()
    try:
        pid = daemon.process.pid
        baseline = daemon_resources(pid)
        # Room for a few more descriptors (each connection holds three: the gate's two and gRPC's):
        # a group of 8 (9 memfds) fails part of the way through, a group of 2 forms.
        limit = limit_leaving(pid, 24)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, limit))
        channel, stub = stub_for(daemon)
        with channel:
            futures = [
                stub.Join.future(join_request(group="big", rank=r, world_size=8, timeout=10), timeout=20)
                for r in range(8)
            ]
            codes = set()
            for future in futures:
                with pytest.raises(grpc.RpcError) as refused:
                    future.result()
                codes.add(
                    (
                        refused.value.code(),
                        "nothing was allocated" in refused.value.details() or refused.value.details(),
                    )
                )
        assert codes == {(grpc.StatusCode.RESOURCE_EXHAUSTED, True)}, codes
        after = settle(daemon, pid, baseline, timeout=10)
        # Back at (or below: an idle connection may have closed) the baseline: nothing leaked.
        assert after["fds"] <= baseline["fds"] and after["memfds"] <= baseline["memfds"], (baseline, after)
        assert spawn_ranks(fault_ranks.reform, 2, 2, daemon.socket, "big", timeout=120).values() == {0: 3.0, 1: 3.0}
    finally:
        daemon.stop(signal.SIGKILL)
    _survived("allocation failing half-way")


def limit_leaving(pid: int, spare: int) -> int:
    """The RLIMIT_NOFILE that leaves `pid` exactly `spare` free descriptor numbers. The limit bounds
    numbers, not counts: a hole left by a closed descriptor is room too, so counting open ones
    (what this once did) could leave a process more room than the test meant."""
    taken = {int(fd.name) for fd in Path(f"/proc/{pid}/fd").iterdir()}
    number, free = 0, 0
    while True:
        if number not in taken:
            free += 1
            if free == spare:
                return number + 1
        number += 1


def test_a_service_allocation_short_of_descriptors_leaves_nothing(tmp_path):
    """Whether the daemon runs out of descriptors creating the memory or handing it out, the rank
    gets RESOURCE_EXHAUSTED and nothing stays allocated; with room again, the same call works."""
    daemon = Daemon(tmp_path, list(DAEMON_ARGS)).start()
    try:
        pid = daemon.process.pid
        with nodecomm.connect("short", 0, 1, socket=daemon.socket, timeout=20) as comm:
            comm.service_buffer(4096).free()  # the service path is set up; what follows only allocates
            baseline = daemon_resources(pid)
            _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
            outcomes = []
            # From one spare: with none, not even the metrics endpoint this test reads can accept.
            for spare in range(1, 7):
                resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit_leaving(pid, spare), hard))
                try:
                    buffer = comm.service_buffer(4096)
                except ResourceExhaustedError as error:
                    outcomes.append("refused")
                    assert "failed" in str(error), error
                    now = daemon_resources(pid)
                    assert now["memfds"] <= baseline["memfds"], (baseline, now)
                    assert now["memfd_mappings"] <= baseline["memfd_mappings"], (baseline, now)
                    assert not [line for line in daemon.metrics_text().splitlines() if 'use="service"} 4096' in line]
                else:
                    outcomes.append("ok")
                    buffer.free()
                    break
            assert outcomes[0] == "refused" and outcomes[-1] == "ok", outcomes
    finally:
        daemon.stop(signal.SIGKILL)
    _survived("descriptors running out for a service allocation")


def test_the_daemon_killed_under_active_groups(tmp_path, spawn_ranks):
    """A group calling on peer paths runs on without a call lost; a service-path call (which
    needs the daemon) fails within its timeout; both names form again on the next daemon."""
    daemon = Daemon(tmp_path, list(DAEMON_ARGS)).start()
    try:
        context = mp.get_context("spawn")
        report, signalled = context.Queue(), context.Queue()
        commands = [context.Queue() for _ in range(2)]
        service = spawn_ranks(
            fault_ranks.work_until_error, 2, 2, daemon.socket, "dk-service", "service", report, signalled
        )  # fmt: skip
        collective = spawn_ranks(
            restart_ranks.ride_through, 2, 2, daemon.socket, free_port(), "connect", report, commands, timeout=180
        )  # fmt: skip
        # Ready and running, of ranks 0 and 1: each once a step of its work is done.
        assert len({report.get(timeout=90) for _ in range(4)}) == 4
        daemon.stop(signal.SIGKILL)
        for _ in range(2):
            signalled.put(time.time())
        for name, message, waited in service.values().values():
            assert name in ("DaemonUnavailableError", "PeerLostError"), (name, message)
            assert waited < OPERATION_TIMEOUT + 15.0, (waited, message)
        daemon.start()
        for queue in commands:
            queue.put("stop")
        for outcome in collective.values().values():
            assert outcome["failed"] == 0 and outcome["wrong"] == 0 and outcome["after"] == [3.0] * 4, outcome
        assert spawn_ranks(fault_ranks.reform, 2, 2, daemon.socket, "dk-service", timeout=120).values() == {
            0: 3.0,
            1: 3.0,
        }
    finally:
        daemon.stop(signal.SIGKILL)
    _survived("daemon killed under active groups")
