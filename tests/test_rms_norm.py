"""all_reduce_rms_norm through the real daemon and rank processes: the same bits as the stated
reference (nodecomm.rms_norm.add_rms_norm of the rank-order sum) on every rank and every path."""

import pytest
import torch

import ranks
from nodecomm.rms_norm import NORM_CHUNK, NORM_LANES, add_rms_norm

PATHS = ["oneshot", "twoshot", "service", None, "inplace"]
DTYPES = ("float32", "float16", "bfloat16")
# Decode (1, 7), a small batch (128) and prefill (4096) at two model widths; prefill on the table's
# path and in place only, where the all-reduce alone takes seconds on two busy cores.
CASES = [(dtype, rows, hidden, PATHS) for dtype in DTYPES for rows in (1, 7, 128) for hidden in (4096, 8192)] + [
    (dtype, 4096, hidden, [None, "inplace"]) for dtype in DTYPES for hidden in (4096, 8192)
]


def expected_names(cases: list) -> list[str]:
    return [f"{dtype} {rows}x{hidden} {path}" for dtype, rows, hidden, paths in cases for path in paths]


def expected(world_size: int, cases: list) -> dict[str, tuple[str, str]]:
    digests = {}
    for index, (dtype_name, rows, hidden, paths) in enumerate(cases):
        dtype = ranks.DTYPES[dtype_name]
        _, residual, weight = ranks.norm_inputs(0, rows, hidden, dtype, index)
        summed = ranks.reference_sum(world_size, rows * hidden, dtype, seed=index).view(rows, hidden)
        out, residual_out = add_rms_norm(summed, residual, weight, 1e-6)
        for path in paths:
            digests[f"{dtype_name} {rows}x{hidden} {path}"] = (ranks.digest(out), ranks.digest(residual_out))
    return digests


def assert_bits(results, want: dict) -> None:
    """Every rank's digests are the reference's, case by case (and no input was modified)."""
    for rank, got in results.values().items():
        wrong = sorted(name for name in set(want) | set(got) if got.get(name) != want.get(name))
        assert not wrong, (rank, wrong)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_bits_equal_the_unfused_reference_on_every_rank_and_path(daemon, spawn_ranks, world_size):
    results = spawn_ranks(ranks.rms_norm_cases, world_size, world_size, daemon.socket, CASES, timeout=900)
    assert_bits(results, expected(world_size, CASES))


@pytest.mark.parametrize("hidden", [1, 5, 7, 4100, 16384])
def test_rows_of_any_width_on_the_cpu(daemon, spawn_ranks, hidden):
    """Hidden sizes that are not whole chunks (NORM_CHUNK), fill the lanes unevenly, or take four rounds of them."""
    cases = [(dtype, rows, hidden, ["oneshot", "twoshot"]) for dtype in DTYPES for rows in (0, 3)]
    results = spawn_ranks(ranks.rms_norm_cases, 2, 2, daemon.socket, cases, timeout=300)
    assert_bits(results, expected(2, cases))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_reference_is_an_rms_norm(dtype):
    """The stated order rounds differently from torch's, but it computes the same function: within
    one unit in the last place of a 16-bit type (16 of fp32, where the orders' sums of squares
    differ) of torch.nn.functional.rms_norm in fp32."""
    summed, residual, weight = (t.to(dtype) for t in ranks.norm_inputs(3, 9, NORM_LANES * NORM_CHUNK + 5, dtype, 0))
    out, residual_out = add_rms_norm(summed, residual, weight, 1e-5)
    assert torch.equal(residual_out, (summed.float() + residual.float()).to(dtype))
    torch_out = torch.nn.functional.rms_norm(residual_out.float(), (weight.numel(),), weight.float(), 1e-5)
    ulps = 16 if dtype == torch.float32 else 1
    ulp = ulps * torch.finfo(dtype).eps * torch_out.abs().clamp(min=torch.finfo(dtype).tiny)
    assert bool(((out.float() - torch_out).abs() <= ulp).all())
