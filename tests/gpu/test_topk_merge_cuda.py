"""vLLM's DCP top-k merge on a CUDA group (ranks sharing the GPU): every rank's rows equal vLLM's
merge as written from its rules (tests/dcp_merge.py), eagerly and in two replays of a graph that
captured the merge."""

import pytest

import dcp_merge

pytestmark = pytest.mark.gpu

MAX_ROWS = 4


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_gets_vllms_merge_eagerly_and_in_replays(make_daemon, spawn_ranks, world_size):
    daemon = make_daemon("--allow-shared-devices", "true")
    seed = 23 + world_size
    got = spawn_ranks(
        dcp_merge.merge_rank, world_size, world_size, daemon.socket, MAX_ROWS, seed, "cuda:0", timeout=400
    ).values()
    for index, case in enumerate(dcp_merge.cases(MAX_ROWS)):
        want = dcp_merge.vllm_merge(case, world_size, seed)
        runs = 3 if case.rows else 1
        for rank in range(world_size):
            assert got[rank][index] == [want] * runs, (case.name, rank)
