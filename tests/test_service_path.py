"""The service path on CPU groups: the daemon runs submitted collectives on the ranks' memory.
Real daemon, real rank processes, results compared by bits."""

import multiprocessing as mp
import os

import grpc
import pytest
import torch

import service_ranks
from conftest import join_request, kill_at_work, reserved_bytes, stub_for
from nodecomm import _native
from nodecomm.v1 import control_pb2 as pb


@pytest.mark.parametrize("world_size", [2, 3])
def test_bit_identical_to_the_shm_paths(daemon, spawn_ranks, world_size):
    # 1 and 7: a scalar tail; 70000: past one 256 KiB chunk of the daemon's executor for 4-byte types.
    counts = [1, 7, 4096, 70000]
    results = spawn_ranks(
        service_ranks.service_cases, world_size, world_size, daemon.socket, counts, timeout=300
    ).values()
    assert results == {r: [] for r in range(world_size)}
    metrics = daemon.metrics_text()
    assert 'nodecomm_service_collectives_total{op="all_reduce",result="ok"}' in metrics
    assert 'nodecomm_service_collectives_total{op="all_gather",result="ok"}' in metrics


def test_queued_submits_run_in_sequence_order(daemon, spawn_ranks):
    steps = 12
    results = spawn_ranks(service_ranks.service_in_order, 3, 3, daemon.socket, steps, timeout=120).values()
    # Ranks start at 1, 2, 3: after the first all-reduce every rank holds 6, then 18, 54, ...
    expected = [[6.0 * 3**k] * 3 for k in range(steps)]
    assert results == {r: expected for r in range(3)}


def test_disagreeing_parts_fail_every_rank_and_the_group_goes_on(daemon, spawn_ranks):
    results = spawn_ranks(service_ranks.service_mismatch, 2, 2, daemon.socket, timeout=120).values()
    for seen in results.values():
        assert seen["error"].startswith("GroupMismatchError"), seen
        assert "disagree on collective 0's count: rank 0 has 8, rank 1 has 16" in seen["error"]
        assert seen["error"].count("[group") == 1, seen["error"]  # located once, by the caller
        assert seen["after"] == [2.0] * 4


def test_a_submit_past_the_queue_is_resource_exhausted_for_every_rank(make_daemon, spawn_ranks):
    depth = 4
    daemon = make_daemon("--service-queue-depth", str(depth))
    context = mp.get_context("spawn")
    report, commands = context.Queue(), context.Queue()
    group = spawn_ranks(service_ranks.service_over_quota, 2, 2, daemon.socket, depth, report, commands, timeout=120)
    assert report.get(timeout=60) == "queued"
    commands.put("go")
    for seen in group.values().values():
        assert seen["last"].startswith("ResourceExhaustedError"), seen
        assert f"collective {depth} is past this group's queue" in seen["last"]
        assert seen["after"] == [2.0] * 16


def test_a_killed_rank_fails_its_peers_pending_submits(daemon, spawn_ranks):
    kill_a_rank_with_submits_pending(daemon, spawn_ranks, "cpu")


def kill_a_rank_with_submits_pending(daemon, spawn_ranks, device: str) -> None:
    """Rank 0 waits on queued submits that rank 1, killed meanwhile, never makes: PeerLostError
    naming rank 1 and the group."""
    report = mp.get_context("spawn").Queue()
    group = spawn_ranks(service_ranks.service_until_peer_dies, 2, 2, daemon.socket, report, device, timeout=120)
    words, results = kill_at_work(group, report)
    assert {word[1] for word in words} == {0, 1}, words
    status, (name, message, _) = results[0]
    assert status == "ok" and name == "PeerLostError", message
    assert "rank 1" in message and "'svc-kill'" in message


# topk 8 with 37 rows: the scores plane starts 1184 bytes in, not on a 64-byte boundary.
@pytest.mark.parametrize("world_size, topk", [(2, 16), (3, 16), (3, 8)])
def test_topk_stage_through_the_daemon_matches_the_slabs(daemon, spawn_ranks, world_size, topk):
    results = spawn_ranks(
        service_ranks.service_topk_cases, world_size, world_size, daemon.socket, [37, 5, 0, 36], topk, timeout=200
    ).values()
    assert results == {r: [] for r in range(world_size)}


# -- the daemon's checks, driven over raw gRPC -----------------------------------------------------


def _join_alone(stub, group: str):
    reply = stub.Join(join_request(group=group, world_size=1, capacity=4096), timeout=10)
    return reply.group_id


def _submit(stub, group, group_id, sequence, allocation_id, offset=0, count=16, **fields):
    ref = pb.MemoryRef(allocation_id=allocation_id, offset_bytes=offset)
    request = pb.SubmitRequest(
        group=group, group_id=group_id, rank=0, sequence=sequence, op=pb.ALL_REDUCE, dtype=pb.FLOAT32,
        count=count, input=ref, output=ref, timeout_seconds=5, **fields,
    )  # fmt: skip
    return stub.Submit(request, timeout=10)


def test_the_daemon_refuses_ranges_it_does_not_own(daemon):
    from nodecomm.client.descriptors import claim_descriptors

    channel, stub = stub_for(daemon)
    with channel:
        group_id = _join_alone(stub, "raw")
        before = reserved_bytes(daemon)
        ids = dict(group="raw", group_id=group_id, rank=0)
        reply = stub.AllocateMemory(pb.AllocateMemoryRequest(**ids, size_bytes=4096), timeout=10)
        assert reserved_bytes(daemon) == before + 4096
        (fd,) = claim_descriptors(daemon.descriptor_socket, reply.claim_token, 1, 5.0)
        assert os.fstat(fd).st_size == 4096
        os.pwrite(fd, torch.full((16,), 2.5).numpy().tobytes(), 64)
        _submit(stub, "raw", group_id, 0, reply.allocation_id, offset=64)  # one rank: the sum is itself
        assert torch.frombuffer(bytearray(os.pread(fd, 64, 64)), dtype=torch.float32).tolist() == [2.5] * 16

        cases = [
            (dict(offset=4096 - 32), grpc.StatusCode.INVALID_ARGUMENT, "run past allocation"),
            (dict(offset=2), grpc.StatusCode.INVALID_ARGUMENT, "not a multiple of the 4-byte element"),
            (dict(count=1 << 62), grpc.StatusCode.INVALID_ARGUMENT, "run past allocation"),
            # How a CUDA rank's stream says its input is ready: nothing a CPU group takes.
            (dict(ready_value=2), grpc.StatusCode.INVALID_ARGUMENT, "ready_value is for CUDA groups ordered by stream"),
            (dict(ready_event=bytes(64)), grpc.StatusCode.INVALID_ARGUMENT, "ready_event is for CUDA groups ordered"),
        ]
        sequence = 1
        for kwargs, code, text in cases:
            with pytest.raises(grpc.RpcError) as refused:
                _submit(stub, "raw", group_id, sequence, reply.allocation_id, **kwargs)
            assert refused.value.code() == code and text in refused.value.details()
            sequence += 1
        with pytest.raises(grpc.RpcError) as refused:
            _submit(stub, "raw", group_id, sequence, reply.allocation_id + 1000)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND and "holds no allocation" in refused.value.details()
        sequence += 1
        with pytest.raises(grpc.RpcError) as refused:
            _submit(stub, "raw", group_id, sequence - 1, reply.allocation_id)
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS

        stub.FreeMemory(pb.FreeMemoryRequest(**ids, allocation_id=reply.allocation_id), timeout=10)
        assert reserved_bytes(daemon) == before
        with pytest.raises(grpc.RpcError) as refused:
            _submit(stub, "raw", group_id, sequence, reply.allocation_id)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND and "was freed" in refused.value.details()
        os.close(fd)
        with pytest.raises(grpc.RpcError) as refused:
            stub.AllocateMemory(pb.AllocateMemoryRequest(**ids, size_bytes=0), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stub.Leave(pb.LeaveRequest(**ids), timeout=10)


def test_the_dispatch_table_can_send_sizes_to_the_service_path(daemon, spawn_ranks):
    results = spawn_ranks(service_ranks.service_by_table, 2, 2, daemon.socket, timeout=120).values()
    for seen in results.values():
        assert seen["rows"] == [(0, 4095, "oneshot"), (4096, None, "service")]
        assert seen["small"] == [3.0] and seen["large"] == [3.0]
    # Only the 16 KiB all-reduce went to the daemon.
    assert 'nodecomm_service_collectives_total{op="all_reduce",result="ok"} 1.0' in daemon.metrics_text()


@pytest.mark.skipif(not hasattr(_native, "CUDA_SERVICE_RELEASED"), reason="a CPU-only build has no CUDA service path")
def test_an_abort_raises_service_words_past_every_sequence_a_stream_waits_for():
    """A stream's wait on a word (cuStreamWaitValue64, GEQ) compares cyclically: it passes once
    (int64_t)(word - value) >= 0. The word's largest value reads as behind every sequence, which
    left a CUDA survivor waiting for ever on a daemon stream held up by a killed rank."""

    def passes(word: int, value: int) -> bool:
        return (word - value) % (1 << 64) < (1 << 63)

    released = _native.CUDA_SERVICE_RELEASED
    assert all(passes(released, value) for value in [1, 2, 1000, 1 << 32, released])
    assert not passes((1 << 64) - 1, 1)
