"""All-reduce through the real daemon and rank processes, compared by bits with an fp32
rank-order reference; oneshot and twoshot must agree with it and with each other."""

import pytest

import ranks

MiB = 1 << 20
SMALL_CASES = [
    (dtype, count)
    for dtype in ("float32", "float16", "bfloat16")
    for count in (0, 1, 7, 1001, (MiB // 2) + 3)  # (MiB//2)+3 elements: 1 MiB + 6 bytes in 16-bit types
] + [("float32", (MiB // 4) + 3)]
LARGE_CASES = [("float32", 16 * MiB), ("bfloat16", 32 * MiB)]  # 64 MiB payloads, chunked


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_bit_exact_against_reference(daemon, spawn_ranks, world_size):
    cases = SMALL_CASES + (LARGE_CASES if world_size in (1, 2, 8) else LARGE_CASES[:1])
    results = spawn_ranks(ranks.all_reduce_cases, world_size, world_size, daemon.socket, cases, timeout=600).values()
    problems = {rank: p for rank, p in results.items() if p}
    assert not problems, problems


def test_largest_world_size(daemon, spawn_ranks):
    cases = [("float32", 0), ("bfloat16", 1), ("float16", 1001), ("float32", (MiB // 4) + 3)]
    results = spawn_ranks(ranks.all_reduce_cases, 16, 16, daemon.socket, cases, timeout=600).values()
    assert not any(results.values()), results


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_routes_by_rank_and_barrier(daemon, spawn_ranks, world_size):
    results = spawn_ranks(ranks.gather_and_barrier, world_size, world_size, daemon.socket).values()
    assert all(p == [] for p in results.values()), results


def test_misuse_raises_clear_errors(daemon, spawn_ranks):
    seen = spawn_ranks(ranks.misuse, 2, 2, daemon.socket).values()[0]
    assert "dtype torch.float16" in seen["dtype"] and "float32" in seen["dtype"]
    assert "torch.Tensor" in seen["not_tensor"]
    assert "contiguous" in seen["strided"]
    assert "shape (4,)" in seen["out_shape"]
    assert "unknown path 'teleport'" in seen["path"]
    assert "not available to a CPU group" in seen["gpu_path"]
    assert seen["still_works"] == [2.0] * 4
    assert seen["native_declines"] == ["dtype", "empty", "out_dtype", "out_shape", "strided", "subclass"]
    assert seen["native_runs"]
    assert seen["table"][0][2] == "oneshot" and seen["table"][-1][2] == "twoshot"
    assert "closed" in seen["closed"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_that_disagree_all_get_group_mismatch_and_the_group_goes_on(daemon, spawn_ranks, world_size):
    """Rank 1 passes another count, dtype, path, shape or collective: every rank raises the same
    GroupMismatchError at the call's first barrier, naming each rank's value; no output is
    written; the ranks' epochs stay in step, so the next call works."""
    results = spawn_ranks(ranks.disagree, world_size, world_size, daemon.socket, timeout=180).values()
    # (what they disagree on, rank 0's value, rank 1's value); ranks past 1 do as rank 0 does.
    cases = {
        "count": ("all_reduce's element count", "has 4096", "has 8192"),
        "count_large": ("all_reduce's element count", "has 1024", "has 1048576"),
        "count_zero": ("all_reduce's element count", "has 16", "has 0"),
        "dtype": ("all_reduce's dtype", "has float32", "has float16"),
        "path": ("all_reduce's path", "has oneshot", "has twoshot"),
        "collective": ("the collective", "calls all_reduce", "calls all_gather"),
        "barrier": ("the collective", "calls all_reduce", "calls barrier"),
        "gather_bytes": ("all_gather's byte count", "has 16", "has 20"),
        "topk_rows": ("top-k stage's row count", "has 8", "has 12"),
        "norm_shape": ("all_reduce_rms_norm's shape (rows x hidden)", "has 2 x 2048", "has 2048 x 2"),
    }
    for rank, outcome in results.items():
        assert set(outcome) == set(cases)
        for case, (name, message, untouched, works_after) in outcome.items():
            field, usual, odd = cases[case]
            values = ", ".join(f"rank {r} {odd if r == 1 else usual}" for r in range(world_size))
            assert name == "GroupMismatchError", (rank, case, name, message)
            assert f"disagree on {field}: {values}; nothing was written to the output" in message, (rank, message)
            # Said once where it happened, without the native source location.
            assert message.startswith(f"[group 'disagree', rank {rank}] "), message
            assert ".h:" not in message and "rank 0: " not in message, message
            assert untouched and works_after, (rank, case)
