"""row_topk (nodecomm.row_topk): the exact top-k of each row of an owner table, with a deterministic tie rule."""

from __future__ import annotations

import math

import torch


def row_topk(idx: torch.Tensor, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top `k` candidates of every row of `idx`, `scores` ([rows, ...], flattened per row):
    descending score, ties broken by the lower index. Returns (indices, scores), each [rows, k].

    Exact and deterministic: two stable sorts, index ascending then score descending (NaN sorts
    above every number, as torch.sort places it; -0.0 and 0.0 tie).
    """
    if idx.shape != scores.shape:
        raise ValueError(f"idx has shape {tuple(idx.shape)} but scores has {tuple(scores.shape)}; expected equal")
    rows = idx.shape[0] if idx.dim() else 0
    width = math.prod(idx.shape[1:])  # an owner with no rows has [0, world, topk] tables
    flat_idx, flat_scores = idx.reshape(rows, width), scores.reshape(rows, width)
    if not 0 <= k <= flat_idx.shape[1]:
        raise ValueError(f"k {k}: expected 0..{flat_idx.shape[1]}, the candidates per row")
    by_index = torch.sort(flat_idx, dim=1, stable=True)
    scores_by_index = torch.gather(flat_scores, 1, by_index.indices)
    by_score = torch.sort(scores_by_index, dim=1, descending=True, stable=True)
    order = by_score.indices[:, :k]
    return torch.gather(by_index.values, 1, order), by_score.values[:, :k]
