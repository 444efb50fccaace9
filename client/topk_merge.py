"""The DCP top-k merge on the owner exchange: every rank holds its top-k of its own KV shard for
each query row; every rank ends with the global top-k of every row, as global token ids.

vLLM's decode context parallelism (DCP) does this by all-gathering every rank's candidates to
every rank, which then all select the same rows' top-k (vLLM 0.34.0:
model_executor/layers/sparse_attn_indexer.py, _merge_dcp_topk_global). Here each row's
candidates go to the row's owner only (TopkExchange.stage), the owner selects its rows, and an
int32 all-gather of the owners' results gives every rank every row: about 1.5/W of that traffic
and 1/W of the selection work.

The selection follows vLLM's stated key, so the result is vLLM's, as a set per row:
- a candidate's score is logits[row, local + row_start] (the column clamped to the last), its
  global id (local // interleave) * (world * interleave) + rank * interleave + local % interleave;
  a local index below 0 is padding (id -1);
- the key is the top `score_bits` of the score's bits with the sign flipped (negative scores'
  bits inverted), so that unsigned order is float order (+0 above -0, as vLLM's); then the id's
  low `id_bits`, smaller ids first; padding is below every candidate and comes out as -1.
One difference, in our favour: vLLM carries ids as float32, exact below 2^24; they are int32 here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nodecomm.errors import InvalidArgumentError
from nodecomm.topk_layout import owned_rows
from nodecomm.topk_rows import row_topk

# (stage, gather): the exchange's stage(ids, scores) -> the owner's tables, and the group's
# all_gather(tensor) -> [world, *tensor.shape].
Stage = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Gather = Callable[[torch.Tensor], torch.Tensor]


def candidates(
    logits: torch.Tensor,
    local: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int,
    row_starts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's candidates as the exchange carries them: (global ids int32, scores float32),
    each [rows, topk]; padding is (-1, -inf)."""
    valid = local >= 0
    safe = local.clamp(min=0).long()
    columns = safe if row_starts is None else safe + row_starts.long().unsqueeze(1)
    columns = columns.clamp(min=0, max=max(logits.shape[1] - 1, 0))
    if logits.shape[1] == 0:  # nothing to read: every candidate is padding
        valid = torch.zeros_like(valid)
        scores = torch.full(local.shape, float("-inf"), dtype=torch.float32, device=local.device)
    else:
        scores = torch.gather(logits, 1, columns).masked_fill(~valid, float("-inf"))
    ids = (safe // interleave) * (world_size * interleave) + rank * interleave + safe % interleave
    return ids.masked_fill(~valid, -1).to(torch.int32), scores


def select(ids: torch.Tensor, scores: torch.Tensor, topk: int, score_bits: int, id_bits: int) -> torch.Tensor:
    """The top `topk` global ids of each owned row ([rows, world, topk] tables), by vLLM's key;
    int32 [rows, topk], -1 where a row has fewer candidates."""
    shape = (ids.shape[0], ids.shape[1] * ids.shape[2])  # rows, every rank's candidates
    bits = scores.reshape(shape).view(torch.int32).long() & 0xFFFFFFFF
    flipped = torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    flat_ids = ids.reshape(shape)
    mask = (1 << id_bits) - 1
    keyed_ids = torch.where(flat_ids < 0, flat_ids, (flat_ids.long() & mask).to(torch.int32))
    score_key = flipped >> (32 - score_bits)
    # vLLM's key of a candidate can be 0, its padding's key (the top score bits all set, the id's
    # low bits too): selected, it comes out -1 there, and so it does here.
    if score_bits + id_bits <= 62:  # the whole key in one int64: one top-k, as vLLM's selector keys it
        key = ((score_key << id_bits) | (~keyed_ids.long() & mask)).masked_fill(flat_ids < 0, -1)
        best = torch.topk(key, topk, dim=1)
        return torch.gather(keyed_ids, 1, best.indices).masked_fill(best.values <= 0, -1)
    # Too wide for one int64: the score's bits, ties to the smaller id (row_topk's two stable sorts).
    chosen, chosen_keys = row_topk(keyed_ids, score_key.masked_fill(flat_ids < 0, -1), topk)
    return chosen.masked_fill((chosen_keys < 0) | ((chosen_keys == 0) & (chosen.long() & mask == mask)), -1)


def merge(
    stage: Stage,
    gather: Gather,
    max_rows: int,
    rank: int,
    world_size: int,
    logits: torch.Tensor,
    topk_indices: torch.Tensor,
    interleave: int,
    row_starts: torch.Tensor | None,
    score_bits: int,
    id_bits: int,
) -> None:
    """Overwrite `topk_indices` (this rank's local top-k) with every row's global top-k, in
    stages of at most `max_rows` rows (checked by the caller: check_merge)."""
    rows, topk = topk_indices.shape
    for start in range(0, rows, max_rows):
        stop = min(rows, start + max_rows)
        starts = None if row_starts is None else row_starts[start:stop]
        ids, scores = candidates(logits[start:stop], topk_indices[start:stop], rank, world_size, interleave, starts)
        owned_ids, owned_scores = stage(ids, scores)
        count = stop - start
        per = -(-count // world_size)
        mine = torch.full((per, topk), -1, dtype=torch.int32, device=topk_indices.device)
        mine[: len(owned_rows(count, world_size, rank))] = select(owned_ids, owned_scores, topk, score_bits, id_bits)
        everyone = gather(mine)  # [world, per, topk]: owner r's rows are rows r * per ...
        topk_indices[start:stop].copy_(everyone.reshape(world_size * per, topk)[:count])


def check_merge(
    logits: object,
    topk_indices: object,
    topk: int,
    device: torch.device,
    interleave: object,
    row_starts: object,
    score_bits: object,
    id_bits: object,
    where: dict,
) -> None:
    """A merge's inputs, as vLLM passes them: fp32 logits [rows, columns] and int32 topk_indices
    [rows, topk] on the group's device, row_starts None or [rows] integers there, interleave at
    least 1, score_bits and id_bits 1..32."""

    def refuse(what: str) -> None:
        raise InvalidArgumentError(what, **where)

    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype != torch.float32:
        refuse(f"logits: expected a float32 [rows, columns] tensor, got {_described(logits)}")
    if not isinstance(topk_indices, torch.Tensor) or topk_indices.dtype != torch.int32 or topk_indices.dim() != 2:
        refuse(f"topk_indices: expected an int32 [rows, {topk}] tensor, got {_described(topk_indices)}")
    if topk_indices.shape[1] != topk or topk_indices.shape[0] != logits.shape[0]:
        refuse(
            f"topk_indices has shape {tuple(topk_indices.shape)}: expected [{logits.shape[0]}, {topk}] (logits' rows, "
            "the exchange's topk)"
        )
    if logits.device != device or topk_indices.device != device:
        refuse(f"this exchange belongs to a group on {device}; got {logits.device} and {topk_indices.device}")
    if row_starts is not None and (
        not isinstance(row_starts, torch.Tensor)
        or row_starts.shape != (logits.shape[0],)
        or row_starts.dtype not in (torch.int32, torch.int64)
        or row_starts.device != device
    ):
        refuse(
            f"row_starts: expected None or int32/int64 [{logits.shape[0]}] on {device}, got {_described(row_starts)}"
        )
    if isinstance(interleave, bool) or not isinstance(interleave, int) or interleave < 1:
        refuse(f"cp_interleave {interleave!r}: expected an integer, at least 1")
    for name, value in (("score_bits", score_bits), ("id_bits", id_bits)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 32:
            refuse(f"{name} {value!r}: expected an integer from 1 to 32")


def _described(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)} on {value.device}"
    return type(value).__name__
