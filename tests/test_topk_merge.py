"""vLLM's DCP top-k merge on the owner exchange (Exchange.merge), CPU groups: real daemon, real
rank processes; every rank's rows equal, as sets, vLLM's merge written from its stated rules
(tests/dcp_merge.py), on random and adversarial inputs."""

import pytest
import torch

import dcp_merge
import nodecomm
from conftest import free_port

MAX_ROWS = 4


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_every_rank_gets_vllms_merge(daemon, spawn_ranks, world_size):
    seed = 11 + world_size
    results = spawn_ranks(dcp_merge.merge_rank, world_size, world_size, daemon.socket, MAX_ROWS, seed, timeout=300)
    got = results.values()
    wanted = [dcp_merge.vllm_merge(case, world_size, seed) for case in dcp_merge.cases(MAX_ROWS)]
    for index, case in enumerate(dcp_merge.cases(MAX_ROWS)):
        for rank in range(world_size):
            assert got[rank][index] == [wanted[index]], (case.name, rank)
    rows = [row for want in wanted for row in want]
    # The cases reach what they are for: rows padded in part and in whole.
    assert any(-1 in row and set(row) != {-1} for row in rows) and any(set(row) == {-1} for row in rows)


def test_bad_merges_are_refused_naming_what_was_expected(daemon):
    with nodecomm.connect("merge-bad", 0, 1, socket=daemon.socket, timeout=30) as comm:
        exchange = comm.topk_exchange(4, 2)
        logits, local = torch.zeros(3, 8), torch.zeros(3, 2, dtype=torch.int32)
        refused = [
            ((logits.double(), local), {}, "logits: expected a float32"),
            ((logits, local.long()), {}, r"topk_indices: expected an int32 \[rows, 2\]"),
            ((logits, local[:, :1]), {}, r"expected \[3, 2\]"),
            ((logits, local), {"cp_interleave": 0}, "cp_interleave 0: expected an integer, at least 1"),
            ((logits, local), {"score_bits": 33}, "score_bits 33: expected an integer from 1 to 32"),
            ((logits, local), {"row_starts": torch.zeros(2, dtype=torch.int32)}, r"row_starts: expected None"),
        ]
        for args, keywords, message in refused:
            with pytest.raises(nodecomm.InvalidArgumentError, match=message):
                exchange.merge(*args, **keywords)
        local[0] = torch.tensor([5, -1])
        exchange.merge(logits, local)  # a group of one: its own top-k, as global ids
        assert local[0].tolist() == [5, -1]


@pytest.mark.parametrize("world_size, glm_first", [(2, False), (3, True)])
def test_vllms_names_run_the_merge_once_the_plugin_registers(daemon, spawn_ranks, world_size, glm_first):
    """Through vLLM's own names (the stand-ins of its modules), with NODECOMM_DCP_TOPK=1: the
    indexer module's merge and glm5next's, imported by name before or after the plugin registers."""
    seed = 5 + world_size
    got = spawn_ranks(
        dcp_merge.vllm_plugin_rank, world_size, world_size, daemon.socket, free_port(), MAX_ROWS, seed, glm_first,
        timeout=300,
    ).values()  # fmt: skip
    for index, case in enumerate(dcp_merge.plugin_cases(MAX_ROWS)):
        want = dcp_merge.vllm_merge(case, world_size, seed)
        for rank in range(world_size):
            assert got[rank][index] == want, (case.name, rank)
