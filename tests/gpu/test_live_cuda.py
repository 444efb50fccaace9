"""Live recalibration on a CUDA group: synthetic timings through real sessions move a CUDA
boundary (dma_min_bytes here), and every rank adopts the new table at the same call."""

import pytest

import ranks

pytestmark = pytest.mark.gpu

ONE_MIB = 1 << 20


def test_dma_reported_faster_takes_the_bucket_for_every_rank(make_daemon, spawn_ranks):
    daemon = make_daemon("--allow-shared-devices", "true", "--table-switch-period", "16", "--live-min-samples", "4")
    # Without an NCCL group the default CUDA table sends 256 KiB+1 .. 6 MiB-1 to twoshot; dma is
    # reported 3x faster in the 256 KiB..1 MiB bucket, so dma_min_bytes moves to the bucket's start.
    synthetic = [("twoshot", ONE_MIB, 60e-6)] * 6 + [("dma", ONE_MIB, 20e-6)] * 6
    results = spawn_ranks(ranks.live_switch, 2, 2, daemon.socket, synthetic, 200, "cuda", timeout=180).values()
    assert results[0]["switched_at"] is not None and results[0]["switched_at"] % 16 == 15
    assert results[0] == results[1]
    assert results[0]["rows"] == [(0, 262144, "oneshot"), (262145, None, "dma")]
    assert "dma_min_bytes=262145 (calibrated)" in results[0]["boundaries"]
    assert 'nodecomm_threshold_changes_total{boundary="dma_min_bytes"} 1.0' in daemon.metrics_text()
