"""Top-k owner exchange on CPU groups: real daemon, real rank processes, bit-exact tables."""

import pytest
import torch

import nodecomm
import ranks


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6, 8])
def test_owner_tables_are_bit_exact(daemon, spawn_ranks, world_size):
    # 37 rows: not divisible by any world size here; 5 rows leave some owners empty at 6 and 8;
    # 0 rows; the same slots reused across more stages than there are slots.
    rows_list = [37, 5, 0, 36, 37, 1]
    results = spawn_ranks(
        ranks.topk_exchange_cases, world_size, world_size, daemon.socket, 37, 16, rows_list, timeout=300
    ).values()
    assert results == {r: [] for r in range(world_size)}


def test_geometry_mismatch_fails_every_rank_before_allocation(daemon, spawn_ranks):
    results = spawn_ranks(ranks.topk_mismatch, 3, 3, daemon.socket, timeout=120).values()
    for rank, seen in results.items():
        assert seen["error"].startswith("GroupMismatchError")
        assert "disagree on the top-k exchange's topk" in seen["error"] and "rank 1 has 8" in seen["error"]
        assert seen["before"] == seen["after_failure"] < seen["after_success"]
        assert seen["staged_rows"] == [3, 3, 2][rank]  # 8 rows over 3 ranks


def test_bad_requests(daemon):
    with nodecomm.connect("topk-bad", 0, 1, socket=daemon.socket, timeout=30) as comm:
        with pytest.raises(nodecomm.InvalidArgumentError, match="at least 1"):
            comm.topk_exchange(0, 16)
        exchange = comm.topk_exchange(4, 2)
        idx, scores = torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 2)
        with pytest.raises(nodecomm.InvalidArgumentError, match="exceed the exchange's max_rows 4"):
            exchange.stage(torch.zeros(5, 2, dtype=torch.int32), torch.zeros(5, 2))
        with pytest.raises(nodecomm.InvalidArgumentError, match="int32 indices and float32 scores"):
            exchange.stage(idx.long(), scores)
        with pytest.raises(nodecomm.InvalidArgumentError, match=r"\[rows, 2\]"):
            exchange.stage(idx[:, :1], scores[:, :1])
        assert exchange.stage(idx, scores)[0].shape == (4, 1, 2)


def _reference_topk(idx: torch.Tensor, scores: torch.Tensor, k: int) -> tuple[list, list]:
    out_idx, out_scores = [], []
    for row_idx, row_scores in zip(
        idx.reshape(idx.shape[0], -1).tolist(), scores.reshape(idx.shape[0], -1).tolist(), strict=True
    ):
        best = sorted(zip(row_scores, row_idx, strict=True), key=lambda pair: (-pair[0], pair[1]))[:k]
        out_scores.append([s for s, _ in best])
        out_idx.append([i for _, i in best])
    return out_idx, out_scores


def test_row_topk_is_exact_with_the_tie_rule():
    generator = torch.Generator().manual_seed(3)
    idx = torch.randperm(40 * 3 * 16, generator=generator).to(torch.int32).view(40, 3, 16)
    # Few distinct scores, so most rows have ties that the index must break; -0.0 ties 0.0.
    scores = torch.randint(-4, 5, (40, 3, 16), generator=generator).float()
    scores[0, 0, 0] = -0.0
    for k in (0, 1, 7, 48):
        got_idx, got_scores = nodecomm.row_topk(idx, scores, k)
        want_idx, want_scores = _reference_topk(idx, scores, k)
        assert got_idx.tolist() == want_idx and got_scores.tolist() == want_scores
        assert torch.equal(got_scores, torch.topk(scores.reshape(40, -1), k, dim=1).values)
    with pytest.raises(ValueError, match="expected 0..48"):
        nodecomm.row_topk(idx, scores, 49)
    # An owner with no rows in a stage gets [0, world, topk] tables: [0, k] out.
    empty_idx, empty_scores = nodecomm.row_topk(idx[:0], scores[:0], 7)
    assert empty_idx.shape == empty_scores.shape == (0, 7)
