"""all_reduce_rms_norm on CUDA groups of ranks sharing the GPU: the same bits as the stated
reference (nodecomm.rms_norm) on every rank and path, fused (oneshot, twoshot) or not (dma, and
payloads past a slot), eager and under graph replay."""

import pytest
from test_rms_norm import DTYPES, assert_bits, expected, expected_names

import ranks

pytestmark = pytest.mark.gpu

PATHS = ["oneshot", "twoshot", "dma", None, "inplace"]
CASES = [(dtype, rows, hidden, PATHS) for dtype in DTYPES for rows in (1, 7, 128, 4096) for hidden in (4096, 8192)]
ODD_CASES = [  # rows of no whole chunks (the norm kernel after the all-reduce), and the widest
    (dtype, rows, hidden, ["oneshot", "twoshot", None])
    for dtype in DTYPES
    for rows in (0, 3)
    for hidden in (1, 4100, 16384)
]


@pytest.fixture
def cuda_daemon(make_daemon):
    return make_daemon("--allow-shared-devices", "true", "--operation-timeout-seconds", "60")


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_bits_equal_the_unfused_reference_on_cuda(cuda_daemon, spawn_ranks, world_size):
    want = expected(world_size, CASES + ODD_CASES)
    for graph, cases in ((False, CASES + ODD_CASES), (True, CASES)):
        results = spawn_ranks(
            ranks.rms_norm_cases, world_size, world_size, cuda_daemon.socket, cases, "cuda", graph, timeout=900
        )
        assert_bits(results, {name: want[name] for name in expected_names(cases)})
