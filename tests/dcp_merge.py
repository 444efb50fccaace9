"""vLLM's DCP top-k merge, for the tests: the inputs every rank makes of a case, the merge as
vLLM states it (sparse_attn_indexer.py's _merge_dcp_topk_global, dcp_indexer_cutedsl.py's pack
and stable_key, vLLM 0.34.0) written here from those rules with Python integers, and the rank that
runs nodecomm's merge on a real group."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

import nodecomm


@dataclass(frozen=True)
class Case:
    """One merge: `rows` query rows of `topk` candidates a rank over `columns` logits columns."""

    name: str
    rows: int
    topk: int
    columns: int
    interleave: int = 1
    score_bits: int = 32
    row_starts: bool = False
    # "random", "bf16" (upcast bf16 logits), "ties" (few values), "low_bits", "negative", "zeros"
    scores: str = "random"
    padding: float = 0.1  # the share of candidates that are -1 (and every 4th row is all -1)
    full_ids: bool = False  # id_bits 32 (vLLM's without num_positions): a key wider than an int64


def cases(max_rows: int) -> list[Case]:
    return [
        Case("random fp32", 5, 16, 64),
        Case("fp32, 32 id bits, ties", 5, 16, 40, scores="ties", full_ids=True),
        Case("bf16 logits, 16 score bits", 7, 16, 64, score_bits=16, scores="bf16"),
        Case("ties across ranks", 6, 16, 40, scores="ties"),
        Case("ties past the 16 bits kept", 6, 16, 40, score_bits=16, scores="low_bits"),
        Case("interleave 4, row starts", 5, 8, 48, interleave=4, row_starts=True),
        Case("mostly padding", 6, 8, 32, padding=0.95),
        # Every score's key 0 in 1 bit: ids decide, and the largest id's whole key is padding's.
        Case("negative scores, 1 score bit", 6, 8, 32, score_bits=1, scores="negative", padding=0.8),
        Case("signed zeros", 5, 8, 32, scores="zeros"),
        Case("all padding", 3, 8, 16, padding=1.0),
        Case(
            "rows past max_rows", 2 * max_rows + 3, 8, 32, interleave=2, row_starts=True, score_bits=16, scores="bf16"
        ),
        Case("no rows", 0, 8, 16),
    ]


def plugin_cases(max_rows: int) -> list[Case]:
    """The cases vLLM can pass: score bits from its logits' dtype (bf16: 16, else 32)."""
    return [case for case in cases(max_rows) if case.score_bits in (16, 32)]


def id_bits(case: Case, world_size: int) -> int:
    """vLLM's dcp_topk_id_bits(num_positions), with every global position of the case below it
    (32 for full_ids: vLLM's without num_positions)."""
    return 32 if case.full_ids else max(1, min(32, (case.columns * world_size - 1).bit_length()))


def rank_inputs(case: Case, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logits [rows, columns] float32, local top-k positions [rows, topk] int32, row starts or None)."""
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    shape = (case.rows, case.columns)
    if case.scores == "negative":
        logits = -torch.rand(shape, generator=generator) - 0.5
    elif case.scores == "zeros":  # +0.0 ranks above -0.0 in vLLM's key
        logits = torch.where(torch.rand(shape, generator=generator) < 0.5, 0.0, -0.0)
    elif case.scores == "ties":
        logits = torch.randint(-3, 4, shape, generator=generator).float()
    elif case.scores == "low_bits":  # equal in their top 16 bits, different below them
        logits = 1.5 + torch.randint(0, 200, shape, generator=generator).float() * 2.0**-20
    else:
        logits = torch.randn(shape, generator=generator)
        if case.scores == "bf16":
            logits = logits.bfloat16().float()
    starts = torch.randint(0, case.columns - case.topk + 1, (case.rows,), generator=generator)
    local = torch.empty(case.rows, case.topk, dtype=torch.int32)
    for row in range(case.rows):
        span = case.columns - (int(starts[row]) if case.row_starts else 0)
        local[row] = torch.randperm(span, generator=generator)[: case.topk].to(torch.int32)
    dropped = torch.rand(local.shape, generator=generator) < case.padding
    if case.scores == "negative":  # the last position first, kept: the last rank's is the largest id
        local[:, 1:] = torch.where(local[:, 1:] == case.columns - 1, local[:, :1], local[:, 1:])
        local[:, 0] = case.columns - 1
        dropped[:, 0] = False
    local[dropped] = -1
    local[::4] = -1
    return logits, local, (starts.to(torch.int32) if case.row_starts else None)


def vllm_merge(case: Case, world_size: int, seed: int) -> list[list[int]]:
    """Every row's global top-k as vLLM's pack and stable-key selection give it, sorted."""
    ids_bits = id_bits(case, world_size)
    id_mask, id_shift = (1 << ids_bits) - 1, 64 - case.score_bits - ids_bits
    everyone = [rank_inputs(case, rank, seed) for rank in range(world_size)]
    merged = []
    for row in range(case.rows):
        keys = []
        for rank, (logits, local, starts) in enumerate(everyone):
            for position in local[row].tolist():
                if position < 0:
                    keys.append(0)  # padding's key
                    continue
                column = min(position + (int(starts[row]) if starts is not None else 0), case.columns - 1)
                score = float(logits[row, column])
                token = (
                    (position // case.interleave) * (world_size * case.interleave)
                    + rank * case.interleave
                    + position % case.interleave
                )
                token = int(struct.unpack("<f", struct.pack("<f", float(token)))[0])  # packed as float32
                bits = struct.unpack("<I", struct.pack("<f", score))[0]
                flipped = bits ^ (0xFFFFFFFF if bits & 0x80000000 else 0x80000000)
                score_key = (flipped >> (32 - case.score_bits)) << (64 - case.score_bits)
                keys.append(score_key | ((~token & 0xFFFFFFFF & id_mask) << id_shift))
        best = sorted(keys, reverse=True)[: case.topk]
        merged.append(sorted(-1 if key == 0 else ~(key >> id_shift) & id_mask for key in best))
    return merged


def merge_rank(
    rank: int, world_size: int, socket: str, max_rows: int, seed: int, device: str = "cpu"
) -> list[list[list[list[int]]]]:
    """Every case of cases(max_rows) merged on a group on `device`, each on one exchange of its
    topk; returns, per case, its rows (each sorted) of every run: the eager call, and on CUDA two
    replays of a graph that captured it (its inputs put back between them)."""
    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    results = []
    with nodecomm.connect("dcp-merge", rank, world_size, device=device, socket=socket, timeout=120) as comm:
        exchanges = {}
        for case in cases(max_rows):
            if case.topk not in exchanges:
                exchanges[case.topk] = comm.topk_exchange(max_rows, case.topk)
            logits, local, starts = (
                None if t is None else t.to(device) for t in rank_inputs(case, rank, seed)
            )  # fmt: skip
            given = local.clone()

            def merge(exchange=exchanges[case.topk], case=case, logits=logits, local=local, starts=starts) -> None:
                exchange.merge(
                    logits, local, cp_interleave=case.interleave, row_starts=starts, score_bits=case.score_bits,
                    id_bits=id_bits(case, world_size),
                )  # fmt: skip

            merge()
            runs = [local.sort(dim=1).values.tolist()]
            if device != "cpu" and case.rows:
                graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
                local.copy_(given)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.graph(graph, stream=stream):
                    merge()
                for _ in range(2):
                    local.copy_(given)
                    graph.replay()
                    runs.append(local.sort(dim=1).values.tolist())
            results.append(runs)
    return results


def vllm_plugin_rank(
    rank: int, world_size: int, socket: str, port: int, max_rows: int, seed: int, glm_first: bool
) -> list[list[list[int]]]:
    # glm_first: no SparseAttnIndexer is built either (glm5next's kpool indexer is another class):
    # the exchange opens at the first merge.
    """The cases through vLLM's own names with nodecomm's plugin registered (NODECOMM_DCP_TOPK=1),
    over the stand-ins in tests/engine_standins: a SparseAttnIndexer built (which opens the
    exchange), then each case through the indexer module's merge (with row starts) or glm5next's
    call of the name it imported (without); glm_first: glm5next imported before the plugin
    registers. A CPU group; returns each case's rows, sorted."""
    import os
    import sys
    import types

    import torch.distributed as dist

    from engine_ranks import STANDINS

    os.environ.update(NODECOMM_SOCKET=socket, NODECOMM_DCP_TOPK="1")
    sys.path.insert(0, STANDINS)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    from vllm.model_executor.layers import sparse_attn_indexer as indexer

    indexer.DCP_GROUP = types.SimpleNamespace(
        cpu_group=dist.new_group(backend="gloo"), world_size=world_size, rank_in_group=rank
    )
    if glm_first:
        from vllm.models.glm5next.nvidia import sparse_indexer as glm
    from nodecomm.integrations import vllm as plugin

    plugin.register()
    if not glm_first:
        from vllm.models.glm5next.nvidia import sparse_indexer as glm
    results = []
    for topk in [] if glm_first else sorted({case.topk for case in cases(max_rows)}):
        buffer = torch.empty(max_rows, topk, dtype=torch.int32)
        indexer.SparseAttnIndexer(None, 128, "ue8m0", topk, 128, 1 << 16, 1 << 16, buffer)
    for case in plugin_cases(max_rows):
        logits, local, starts = rank_inputs(case, rank, seed)
        dtype = torch.bfloat16 if case.score_bits == 16 else torch.float32
        positions = None if case.full_ids else case.columns * world_size
        if case.row_starts or case.full_ids:
            indexer._merge_dcp_topk_global(
                logits, local, case.topk, rank, world_size, case.interleave, row_starts=starts, logits_dtype=dtype,
                num_positions=positions, direct_max_rows=max_rows,
            )  # fmt: skip
        else:
            glm.merge_pools(logits, local, case.topk, rank, world_size, case.interleave, dtype, positions)
        results.append(local.sort(dim=1).values.tolist())
    dist.destroy_process_group()
    return results
