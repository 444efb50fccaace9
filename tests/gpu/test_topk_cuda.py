"""The top-k owner exchange on CUDA groups: one kernel per stage, through the real daemon, rank
processes sharing the GPU where there is one; owner tables compared bit for bit."""

import pytest

import cuda_ranks

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_owner_tables_are_bit_exact_eager_and_in_graphs(make_daemon, spawn_ranks, world_size):
    daemon = make_daemon("--allow-shared-devices", "true", "--operation-timeout-seconds", "60")
    # 37 rows: no world size here divides it; 5: some owners empty at 8; 0: no launch at all;
    # topk 16 takes the 16-byte path, 13 the element path.
    for topk in (16, 13):
        results = spawn_ranks(
            cuda_ranks.topk_exact, world_size, world_size, daemon.socket, 64, topk, [37, 5, 0, 64, 37, 1],
            world_size - 1, timeout=600,
        ).values()  # fmt: skip
        assert results == {r: [] for r in range(world_size)}, topk


def test_slab_offsets_past_two_gib(make_daemon, spawn_ranks):
    # Each owner's plane is 49152 x 2 x 2048 x 4 bytes = 768 MiB: slot 1's score plane starts 2.25 GiB in.
    daemon = make_daemon(
        "--allow-shared-devices", "true", "--max-reserved-bytes", "24GiB", "--max-reserved-bytes-per-caller", "24GiB"
    )
    results = spawn_ranks(cuda_ranks.topk_large_offsets, 2, 2, daemon.socket, 49152, 2048, timeout=600).values()
    assert results == {0: 0, 1: 0}
