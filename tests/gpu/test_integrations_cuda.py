"""NodecommAllreduce on CUDA, driven as vLLM and SGLang drive their custom all-reduce: warm-up
inside capture(), a captured CUDA graph replayed with new inputs, eager calls; the sizes the
dispatch table gives NCCL are declined and run by the engine's own all-reduce instead."""

import pytest

import engine_ranks
from conftest import free_port

pytestmark = pytest.mark.gpu

# bfloat16 elements: 16 B, 2 KB, 8.2 KB (nodecomm); 80 KB and 2 MiB (past twoshot_max: NCCL's).
COUNTS = [8, 1000, 4100, 40_000, 1 << 20]


@pytest.mark.parametrize("engine", ["vllm", "sglang", "vllm-platform"])
def test_engine_call_sequence_with_graphs(make_daemon, spawn_ranks, engine):
    daemon = make_daemon(
        "--allow-shared-devices", "true",
        env={"NODECOMM_ONESHOT_MAX_BYTES": "16KiB", "NODECOMM_TWOSHOT_MAX_BYTES": "64KiB", "NODECOMM_DMA_MIN_BYTES": "off"},
    )  # fmt: skip
    results = spawn_ranks(
        engine_ranks.engine_sequence, 2, 2, daemon.socket, free_port(), engine, "cuda", COUNTS, timeout=300
    ).values()
    for outcome in results.values():
        assert outcome["class"] == "NodecommAllreduce" and not outcome["disabled"]
        assert outcome["problems"] == []
        assert outcome["taken"] == {count: count * 2 <= 64 << 10 for count in COUNTS}
        assert outcome["released"]


def test_a_batch_invariant_engine_gets_every_size_on_lossless_paths_on_cuda(make_daemon, spawn_ranks):
    """As on the CPU, with a table whose sizes past 64 KiB would go to NCCL for an engine that is
    not batch-invariant: under VLLM_BATCH_INVARIANT=1 the slot takes 1, 7 and 300 rows of 16384
    bfloat16 (the last 9.6 MiB) and a row's bits are the same in each, the fp32 rank-order sum."""
    daemon = make_daemon(
        "--allow-shared-devices", "true",
        env={"NODECOMM_ONESHOT_MAX_BYTES": "16KiB", "NODECOMM_TWOSHOT_MAX_BYTES": "64KiB", "NODECOMM_DMA_MIN_BYTES": "off"},
    )  # fmt: skip
    results = spawn_ranks(
        engine_ranks.batch_invariant_rows, 2, 2, daemon.socket, free_port(), 16384, "cuda", timeout=300
    ).values()
    for outcome in results.values():
        assert outcome == {"taken": {1: True, 7: True, 300: True}, "same": True, "exact": True}, outcome
