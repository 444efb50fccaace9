"""Compressed wires on CUDA groups, through the real daemon and rank processes sharing the GPU:
oneshot, twoshot and dma give the torch reference's bits (the CPU transport's too) within the
stated bound, eagerly, into unaligned outputs, in pieces and under graph replay; non-finite and
zero blocks; E4M3's every code. (Ranks that disagree on the wire: test_cuda_group.py.)"""

import pytest

import wire_ranks

pytestmark = pytest.mark.gpu

PATHS = ("oneshot", "twoshot", "dma")
CASES = [
    *[(dtype, count) for dtype in ("float32", "float16", "bfloat16") for count in (1, 31, 33, 4099, 300_001)],
    ("float32", (2 << 20) + 17),  # 8 MiB of float32: pieces of what the default slot holds encoded
    ("bfloat16", (5 << 20) + 3),
]


@pytest.fixture
def cuda_daemon(make_daemon):
    return make_daemon("--allow-shared-devices", "true", "--operation-timeout-seconds", "60")


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_cuda_path_gives_the_references_bits_within_the_bound(cuda_daemon, spawn_ranks, world_size):
    cases = CASES if world_size < 4 else CASES[:-2]
    results = spawn_ranks(
        wire_ranks.compressed_cases, world_size, world_size, cuda_daemon.socket, cases, "cuda", PATHS, timeout=900
    )
    problems = {rank: p for rank, p in results.values().items() if p}
    assert not problems, problems


def test_non_finite_and_zero_blocks_and_every_e4m3_code(cuda_daemon, spawn_ranks):
    wire_ranks.check_special_blocks(spawn_ranks(wire_ranks.special_blocks, 2, 2, cuda_daemon.socket, "cuda").values())


@pytest.mark.parametrize("world_size", [2, 4])
def test_compressed_calls_replay_in_graphs_and_run_back_to_back(cuda_daemon, spawn_ranks, world_size):
    results = spawn_ranks(
        wire_ranks.compressed_in_graphs, world_size, world_size, cuda_daemon.socket, "cuda", timeout=600
    )
    assert results.values() == {r: [] for r in range(world_size)}
