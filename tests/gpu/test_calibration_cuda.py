"""nodecomm calibrate --device cuda end to end: the probe's ranks time oneshot, twoshot and dma in
CUDA graphs (sharing the GPU where there is one), the boundaries are placed, persisted, and reused
by a restarted daemon without probing again."""

import json

import pytest

from test_cli import nodecomm_cli

pytestmark = pytest.mark.gpu

BOUNDARIES = ("oneshot_max_bytes", "twoshot_max_bytes", "dma_min_bytes")


def test_cuda_calibration_persists_and_a_restarted_daemon_reuses_it(make_daemon, tmp_path):
    # Three sizes: without MPS, ranks sharing a GPU time-slice, ~2 ms a barrier; this checks the
    # flow, not the numbers (.ci/device-operator.sh measures those under MPS).
    state = tmp_path / "state"
    daemon = make_daemon("--allow-shared-devices", "true", "--state-dir", str(state))
    plot = tmp_path / "calibration-cuda.png"
    result = nodecomm_cli(
        "--socket", daemon.socket, "calibrate", "--device", "cuda", "--world-size", "2",
        "--min-bytes", "4KiB", "--max-bytes", "16KiB", "--json", "--plot", str(plot),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads(result.stdout[result.stdout.index("{") :])
    boundaries = {b["name"]: b for b in document["boundaries"]}
    assert all(boundaries[name]["source"] == "calibrated" for name in BOUNDARIES), boundaries
    assert {"oneshot", "twoshot", "dma"} <= {p["path"] for p in document["points"]}
    assert all(p["seconds"] > 0 for p in document["points"])
    stored = json.loads((state / f"calibration-{document['fingerprint_key']}.json").read_text())
    assert stored["fingerprint"]["device_kind"] == "cuda"
    assert stored["boundaries"] == {name: boundaries[name]["value_bytes"] for name in BOUNDARIES}

    daemon.stop()
    daemon.start()
    again = json.loads(nodecomm_cli("--socket", daemon.socket, "thresholds", "--device", "cuda", "--json").stdout)
    assert {b["name"]: b for b in again["boundaries"]} == boundaries
    assert '"msg": "calibrated"' not in daemon.log()
