"""The service path on CUDA groups: rank processes (sharing the GPU where there is one) submit
collectives that the daemon runs on its own stream, ordered in both directions by stream words
or by IPC events (every test runs under both).
The rank programs are the CPU service tests' (tests/service_ranks.py), run with device="cuda"."""

import pytest

import cuda_ranks
import service_ranks
from test_service_path import kill_a_rank_with_submits_pending

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["stream-words", "ipc-events"])
def cuda_daemon(make_daemon, request):
    return make_daemon("--allow-shared-devices", "true", "--cuda-service-ordering", request.param)


@pytest.mark.parametrize("world_size", [2, 3])
def test_bit_identical_to_the_peer_paths(cuda_daemon, spawn_ranks, world_size):
    counts = [1, 7, 4096, 70000]
    results = spawn_ranks(
        service_ranks.service_cases, world_size, world_size, cuda_daemon.socket, counts, "cuda", timeout=300
    ).values()
    assert results == {r: [] for r in range(world_size)}


def test_queued_submits_run_in_sequence_order(cuda_daemon, spawn_ranks):
    steps = 12
    results = spawn_ranks(service_ranks.service_in_order, 3, 3, cuda_daemon.socket, steps, "cuda", timeout=120).values()
    expected = [[6.0 * 3**k] * 3 for k in range(steps)]
    assert results == {r: expected for r in range(3)}


def test_no_host_synchronisation(cuda_daemon, spawn_ranks):
    calls = 8
    results = spawn_ranks(cuda_ranks.service_without_host_sync, 2, 2, cuda_daemon.socket, calls, timeout=120)
    for seen in results.values().values():
        assert seen["stream_busy_after_waits"], seen  # a wait that synchronised would find it idle
        assert seen["value"] == 2.0**calls, seen


def test_disagreeing_parts_fail_every_rank(cuda_daemon, spawn_ranks):
    results = spawn_ranks(service_ranks.service_mismatch, 2, 2, cuda_daemon.socket, "cuda", timeout=120).values()
    for seen in results.values():
        assert seen["error"].startswith("GroupMismatchError"), seen
        assert "disagree on collective 0's count: rank 0 has 8, rank 1 has 16" in seen["error"]
        assert seen["after"] == [2.0] * 4


def test_a_killed_rank_fails_its_peers_pending_submits(cuda_daemon, spawn_ranks):
    kill_a_rank_with_submits_pending(cuda_daemon, spawn_ranks, "cuda")


def test_an_abort_releases_a_survivors_wait_on_its_done_word(cuda_daemon, spawn_ranks):
    results = spawn_ranks(cuda_ranks.done_word_after_a_peer_leaves, 2, 2, cuda_daemon.socket, timeout=120).values()
    assert results[0] == {"stream_ran_on": True, "abort": True, "marker": 1.0}, results


@pytest.mark.parametrize("world_size", [2, 3])
def test_topk_stage_through_the_daemon_matches_the_kernel(cuda_daemon, spawn_ranks, world_size):
    results = spawn_ranks(
        service_ranks.service_topk_cases,
        world_size,
        world_size,
        cuda_daemon.socket,
        [37, 5, 0, 36],
        16,
        "cuda",
        timeout=200,
    ).values()
    assert results == {r: [] for r in range(world_size)}
