"""Compressed wires (int8, fp8) on CPU groups, through the real daemon and rank processes: the
bits of a torch reference on every rank, within the error bound the docs state, non-finite and
zero blocks, disagreement, and never a compressed wire for a group or call that did not ask."""

import dataclasses
import multiprocessing as mp

import pytest

import wire_ranks
from nodecomm.service.calibration.boundaries import calibration_from
from nodecomm.service.calibration.fingerprint import cpu_fingerprint
from nodecomm.service.calibration.stored import CalibrationStore
from waiting import wait_until

CASES = [
    (dtype, count)
    for dtype in ("float32", "float16", "bfloat16")
    for count in (0, 1, 31, 33, 4099, (1 << 20) + 17)  # partial blocks; the last is chunked
]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_rank_gets_the_references_bits_within_the_bound(daemon, spawn_ranks, world_size):
    cases = CASES if world_size in (2, 3) else [c for c in CASES if c[1] < (1 << 20)]
    results = spawn_ranks(wire_ranks.compressed_cases, world_size, world_size, daemon.socket, cases, timeout=600)
    problems = {rank: p for rank, p in results.values().items() if p}
    assert not problems, problems


def test_non_finite_blocks_give_nan_and_zero_blocks_stay_zero(daemon, spawn_ranks):
    wire_ranks.check_special_blocks(spawn_ranks(wire_ranks.special_blocks, 2, 2, daemon.socket).values())


def test_ranks_that_disagree_on_the_wire_all_get_group_mismatch(daemon, spawn_ranks):
    results = spawn_ranks(wire_ranks.disagree_on_wire, 3, 3, daemon.socket).values()
    for rank, text in results.items():
        message, after = text.split(" | ")
        assert "disagree on all_reduce's wire format: rank 0 has lossless, rank 1 has int8, rank 2 has lossless" in (
            message
        ), (rank, message)
        assert after == "after 3.0"


def _held(daemon, spawn_ranks, group: str, kwargs: dict, sizes: list[int]) -> tuple[dict, dict[str, float]]:
    """Rank 0's table_wires, and the daemon's all-reduce counts of the group by wire while it is
    held (the ranks report counts about once a second; the series go with the group)."""
    context = mp.get_context("spawn")
    report, commands = context.Queue(), context.Queue()
    held = spawn_ranks(wire_ranks.table_wires, 2, 2, daemon.socket, group, kwargs, sizes, report, commands)
    assert {report.get(timeout=60) for _ in range(2)} == {0, 1}

    def series() -> dict[str, float]:
        counts = {}
        for line in daemon.metrics_text().splitlines():
            if line.startswith("nodecomm_wire_operations_total{") and f'group="{group}"' in line:
                counts[line.split('wire="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        return counts

    def every_call_counted() -> dict[str, float] | None:
        counts = series()
        return counts if sum(counts.values()) >= 2 * len(sizes) else None

    try:
        counted = wait_until(every_call_counted, 15, lambda: f"both ranks' calls counted by wire (now {series()})")
    finally:
        for _ in range(2):
            commands.put("stop")
    return held.values()[0], counted


def test_only_a_group_that_asked_gets_a_compressed_wire_from_its_table(daemon, spawn_ranks):
    sizes = [1 << 10, 4 << 10, 64 << 10, 1 << 20]
    plain, counted = _held(daemon, spawn_ranks, "plain", {"thresholds": {"compressed_min_bytes": "4KiB"}}, sizes)
    assert plain["wire"] == "lossless" and {r[3] for r in plain["ranges"]} == {"lossless"}
    assert set(plain["took"].values()) == {"lossless"}
    assert counted == {"lossless": 2 * len(sizes)}  # both ranks' calls; no compressed series at all
    asked, counted = _held(
        daemon, spawn_ranks, "asked", {"wire": "int8", "thresholds": {"compressed_min_bytes": "4KiB"}}, sizes
    )
    assert asked["wire"] == "int8"
    assert asked["ranges"] == [(0, 4095, "oneshot", "lossless"), (4096, 32768, "oneshot", "int8"),
                               (32769, None, "twoshot", "int8")]  # fmt: skip
    assert asked["took"] == {1 << 10: "lossless", 4 << 10: "int8", 64 << 10: "int8", 1 << 20: "int8"}
    assert counted == {"lossless": 2, "int8": 2 * (len(sizes) - 1)}
    # Without a compressed_min_bytes (none calibrated or set), even a group that asked stays lossless.
    uncalibrated, counted = _held(daemon, spawn_ranks, "uncalibrated", {"wire": "fp8"}, sizes)
    assert set(uncalibrated["took"].values()) == {"lossless"} and counted == {"lossless": 2 * len(sizes)}


def test_live_timings_move_a_calibrated_compressed_min_for_every_rank_at_once(make_daemon, spawn_ranks, tmp_path):
    """A stored calibration gives int8 groups compressed_min_bytes=1MiB; the group's timings show
    int8 10x faster at 16 KiB, so the boundary moves down to that bucket, on every rank at once."""
    state = tmp_path / "state"
    state.mkdir()
    sizes = [1 << k for k in range(10, 17)]
    medians = {"oneshot": dict.fromkeys(sizes, 1e-6), "twoshot": dict.fromkeys(sizes, 2e-6)}
    calibration = calibration_from(cpu_fingerprint(), medians)
    CalibrationStore(str(state)).save(dataclasses.replace(calibration, wire_boundaries={"int8": 1 << 20}))
    daemon = make_daemon("--state-dir", str(state), "--table-switch-period", "16", "--live-min-samples", "4")
    synthetic = [("oneshot", 16 << 10, 100e-6, "lossless")] * 6 + [("oneshot", 16 << 10, 10e-6, "int8")] * 6
    results = spawn_ranks(wire_ranks.live_wire_switch, 2, 2, daemon.socket, synthetic, 200, timeout=120).values()
    assert results[0] == results[1] and results[0]["switched_at"] % 16 == 15
    assert results[0]["rows"] == [(0, 4096, "oneshot", "lossless"), (4097, 65536, "oneshot", "int8"),
                                  (65537, None, "twoshot", "int8")]  # fmt: skip
    assert results[0]["initial"] == "compressed_min_bytes=1MiB (calibrated)"
    assert results[0]["boundary"] == "compressed_min_bytes=4097 (calibrated)"
    assert 'nodecomm_threshold_changes_total{boundary="compressed_min_bytes"} 1.0' in daemon.metrics_text()
