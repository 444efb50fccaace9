"""One local user against another's groups: each test is an attack on a running daemon, which
must fail with a clear error while an ordinary 2-rank group beside it still connects and runs 100
all-reduces (its connect time and p50 printed beside the same without the attack). The threat
model and these figures are in docs/security.md."""

import json

import ranks
from nodecomm.service.calibration import cpu_fingerprint, fingerprint_key
from test_cli import nodecomm_cli


def legitimate_group(spawn_ranks, socket: str, name: str) -> tuple[float, float]:
    """(slowest rank's connect seconds, slowest rank's p50 seconds) of an ordinary group."""
    results = spawn_ranks(ranks.legitimate_traffic, 2, 2, socket, name, timeout=120).values()
    return max(r[0] for r in results.values()), max(r[1] for r in results.values())


def report(what: str, baseline: tuple[float, float], attacked: tuple[float, float]) -> None:
    print(
        f"{what}: connect {baseline[0] * 1e3:.0f} ms without, {attacked[0] * 1e3:.0f} ms with; "
        f"p50 {baseline[1] * 1e6:.1f} us without, {attacked[1] * 1e6:.1f} us with"
    )


# A stored calibration that parses but holds what the daemon never writes, and what the log says.
BAD_CALIBRATIONS = {
    "a string boundary": (
        lambda good: good["boundaries"].update(oneshot_max_bytes="abc"),
        "boundaries.oneshot_max_bytes: 'abc' is not of type 'integer', 'null'",
    ),
    "a list of boundaries": (
        lambda good: good.update(boundaries=[1, 2]),
        "boundaries: [1, 2] is not of type 'object'",
    ),
    "a negative boundary": (
        lambda good: good["boundaries"].update(oneshot_max_bytes=-5),
        "boundaries.oneshot_max_bytes: -5 is less than the minimum of 0",
    ),
    "a boundary past any size": (
        lambda good: good["boundaries"].update(oneshot_max_bytes=1.5e300),
        "boundaries.oneshot_max_bytes: 1.5e+300 is greater than the maximum",
    ),
    "another device kind's fingerprint": (
        lambda good: good["fingerprint"].update(device_kind="cuda"),
        "its fingerprint is not this machine's (it differs in device_kind)",
    ),
}


def test_a_calibration_file_with_bad_values_is_ignored_naming_file_and_field(make_daemon, spawn_ranks, tmp_path):
    """4: every bad file leaves a serving daemon with the built-in boundaries, and says why."""
    fingerprint = cpu_fingerprint()
    key = fingerprint_key(fingerprint)
    good = {
        "key": key,
        "fingerprint": fingerprint,
        "boundaries": {"oneshot_max_bytes": 4096},
        "medians": {"oneshot": {"1024": 1e-5}, "twoshot": {"1024": 2e-5}},
        "measured_at": 0.0,
    }
    baseline_state = tmp_path / "good"
    baseline_state.mkdir()
    (baseline_state / f"calibration-{key}.json").write_text(json.dumps(good))
    daemon = make_daemon("--state-dir", str(baseline_state))
    assert "oneshot_max_bytes=4KiB (calibrated)" in nodecomm_cli("--socket", daemon.socket, "thresholds").stdout
    baseline = legitimate_group(spawn_ranks, daemon.socket, "before")
    daemon.stop()
    for case, (spoil, logged) in BAD_CALIBRATIONS.items():
        state = tmp_path / case.replace(" ", "-").replace("'", "")
        state.mkdir()
        bad = json.loads(json.dumps(good))
        spoil(bad)
        path = state / f"calibration-{key}.json"
        path.write_text(json.dumps(bad))
        daemon = make_daemon("--state-dir", str(state))
        shown = nodecomm_cli("--socket", daemon.socket, "thresholds").stdout
        assert "(calibrated)" not in shown and "(default)" in shown, (case, shown)
        assert f"ignoring the calibration in {path}: {logged}" in daemon.log(), (case, daemon.log()[-2000:])
        report(f"calibration with {case}", baseline, legitimate_group(spawn_ranks, daemon.socket, "after"))
        daemon.stop()
