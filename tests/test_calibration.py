"""Calibration: boundary placement from measurements, and the CPU probe end to end through the
daemon, persisted and reused by a restarted daemon without probing again.

What the daemon makes of timings (placing, storing, refusing noise) is driven with given timings
through its TableKeeper. A real probe on a machine shared with other work may measure noise, which
the daemon must refuse: the end-to-end tests take either outcome and assert each; only
test_a_busy_machine_is_not_calibrated loads the machine, on purpose, to test that refusal."""

import asyncio
import dataclasses
import json
import logging
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Daemon, stub_for
from nodecomm.errors import InternalError
from nodecomm.service.calibration.boundaries import (
    calibration_from,
    compressed_min,
    cuda_boundaries,
    small_path_max,
    wire_boundaries,
)
from nodecomm.service.calibration.fingerprint import cpu_fingerprint
from nodecomm.service.calibration.probe import Measured, measured_from_rows
from nodecomm.service.calibration.stored import Calibration, CalibrationStore, InvalidCalibrationError
from nodecomm.service.calibration.tables import TableKeeper
from nodecomm.service.config import DEFAULT_BOUNDARIES, DaemonConfig
from nodecomm.service.metrics.families import DaemonMetrics
from nodecomm.socket_path import lease_socket_path
from nodecomm.thresholds import Boundary, DispatchTable, Source, Wire
from nodecomm.v1 import control_pb2 as pb
from test_cli import nodecomm_cli
from waiting import wait_until

SIZES = [1 << k for k in range(10, 17)]  # 1 KiB .. 64 KiB


def _times(values):
    return dict(zip(SIZES, values, strict=True))


@pytest.mark.parametrize(
    "small, large, expected",
    [
        # twoshot wins clearly from 16 KiB on: oneshot up to 8 KiB.
        ([1, 1, 1, 1, 2, 4, 8], [2, 2, 2, 2, 1, 2, 4], 8 << 10),
        # the large path wins only at the last size: a tail of one is not enough evidence.
        ([1, 1, 1, 1, 1, 1, 2], [2, 2, 2, 2, 2, 2, 1], 64 << 10),
        # within the 2% margin everywhere: nothing moves, the small path keeps the sweep.
        ([1.0] * 7, [0.99] * 7, 64 << 10),
        # a win in the middle that does not last to the end is noise.
        ([1, 1, 2, 2, 1, 1, 1], [2, 2, 1, 1, 2, 2, 2], 64 << 10),
        # the large path wins from the smallest size: the small path never wins and is off.
        ([2] * 7, [1] * 7, None),
    ],
)
def test_small_path_max(small, large, expected):
    assert small_path_max(SIZES, _times(small), _times(large)) == expected


CUDA_SIZES = [1 << k for k in range(12, 29, 2)]  # 4 KiB .. 256 MiB in steps of 4


def _cuda_medians(**winners: list[int]) -> dict[str, dict[int, float]]:
    """Medians where each named path is fastest at the sizes listed (by index), 2x slower elsewhere."""
    medians = {}
    for path, indices in winners.items():
        medians[path] = {size: (1.0 if i in indices else 2.0) * size for i, size in enumerate(CUDA_SIZES)}
    return medians


@pytest.mark.parametrize(
    "winners, fallback, expected",
    [
        # One GPU's probe: no NCCL. oneshot, then twoshot, then dma, each from where it wins.
        (dict(oneshot=[0, 1, 2], twoshot=[3, 4, 5], dma=[6, 7, 8]), "twoshot", (64 << 10, 4 << 20, 16 << 20)),
        # NCCL wins in the middle: the sizes between twoshot and dma are the fallback's.
        (
            dict(oneshot=[0, 1], twoshot=[2, 3], nccl=[4, 5, 6], dma=[7, 8]),
            "nccl",
            (16 << 10, 256 << 10, 64 << 20),
        ),
        # The same numbers for groups without NCCL: twoshot and dma tie where NCCL won, and the
        # tie goes to the later switch.
        (dict(oneshot=[0, 1], twoshot=[2, 3], nccl=[4, 5, 6], dma=[7, 8]), "twoshot", (16 << 10, 16 << 20, 64 << 20)),
        # twoshot never wins: off, and dma takes over from oneshot.
        (dict(oneshot=[0, 1, 2, 3], twoshot=[], dma=[4, 5, 6, 7, 8]), "twoshot", (256 << 10, None, 1 << 20)),
        # dma never wins: off.
        (dict(oneshot=[0, 1, 2], twoshot=[3, 4, 5, 6, 7, 8], dma=[]), "twoshot", (64 << 10, 256 << 20, None)),
        # oneshot never wins.
        (dict(oneshot=[], twoshot=[0, 1, 2, 3], dma=[4, 5, 6, 7, 8]), "twoshot", (None, 256 << 10, 1 << 20)),
        # oneshot beats NCCL at one size in NCCL's range (a payload just past a slot, say): a
        # blip, not a crossover; the 2x-H200 bench showed one at 8 MiB.
        (dict(oneshot=[0, 1, 5], twoshot=[], nccl=[2, 3, 4, 6, 7, 8], dma=[]), "nccl", (16 << 10, None, None)),
    ],
)
def test_cuda_boundaries(winners, fallback, expected):
    medians = _cuda_medians(**winners)
    for path in ("oneshot", "twoshot", "dma"):
        medians.setdefault(path, {size: 2.0 * size for size in CUDA_SIZES})
    boundaries = cuda_boundaries(medians, fallback)
    assert (boundaries["oneshot_max_bytes"], boundaries["twoshot_max_bytes"], boundaries["dma_min_bytes"]) == expected


def test_cuda_boundaries_need_every_path_and_use_the_sizes_all_have():
    medians = _cuda_medians(oneshot=[0, 1, 2], twoshot=[3, 4, 5], dma=[6, 7, 8])
    with pytest.raises(InternalError, match="the probe measured no nccl"):
        cuda_boundaries(medians, "nccl")
    del medians["twoshot"][CUDA_SIZES[0]]  # a size one path lacks is left out, not a KeyError
    assert cuda_boundaries(medians, "twoshot")["dma_min_bytes"] == 16 << 20


def test_calibrating_cuda_without_a_gpu_is_refused(daemon):
    result = nodecomm_cli("--socket", daemon.socket, "calibrate", "--device", "cuda")
    assert result.returncode == 1 and "this daemon sees no GPU to calibrate" in result.stderr, result.stderr


# Timings as a quiet machine's probe measures them (slowest rank's median seconds, middle halves
# narrow, the ranks on a whole core each): twoshot wins by far more than the margin from 16 KiB to
# the end of the sweep, so oneshot keeps up to 8 KiB (the built-in default is 32 KiB). int8 on
# twoshot wins from 32 KiB.
_QUIET_US = {
    "oneshot": [10, 11, 12, 14, 20, 30, 50],
    "twoshot": [20, 20, 21, 22, 16, 20, 28],
    "oneshot+int8": [15, 16, 17, 19, 25, 35, 55],
    "twoshot+int8": [30, 30, 30, 30, 18, 15, 20],
}


def _measured(paths: tuple[str, ...], cpu_share: float) -> Measured:
    """What a probe of `paths` measured over SIZES, its ranks having `cpu_share` of a core each."""
    return Measured(
        {path: _times([us * 1e-6 for us in _QUIET_US[path]]) for path in paths},
        {path: _times([0.1] * len(SIZES)) for path in paths},
        {path: _times([cpu_share] * len(SIZES)) for path in paths},
    )


QUIET = _measured(("oneshot", "twoshot"), 0.9)
QUIET_WITH_INT8 = _measured(tuple(_QUIET_US), 0.9)
BUSY = _measured(("oneshot", "twoshot"), 0.3)  # the ranks had 30% of a core: every point is noise


def _keeper(state: Path, writable: bool = True) -> tuple[TableKeeper, CalibrationStore]:
    """The daemon's own table keeper and calibration store, in this process, to be given timings."""
    return TableKeeper(DaemonConfig(state_dir=str(state)), DaemonMetrics(), 16), CalibrationStore(str(state), writable)


def _calibrations(keeper: TableKeeper, result: str) -> float | None:
    return keeper.metrics.registry.get_sample_value("nodecomm_calibrations_total", {"result": result})


def _points(medians: dict[str, dict[int, float]]) -> list[tuple[str, int, float]]:
    return [(label, size, seconds) for label, by_size in sorted(medians.items()) for size, seconds in by_size.items()]


def _reply_points(reply: pb.CalibrateReply) -> list[tuple[str, int, float]]:
    def label(point: pb.CalibrationPoint) -> str:
        path = pb.Path.Name(point.path).lower()
        return path if point.wire == pb.LOSSLESS else f"{path}+{pb.Wire.Name(point.wire).lower()}"

    return [(label(p), p.bytes, p.seconds) for p in reply.points]


def _thresholds(daemon: Daemon) -> list[dict]:
    shown = nodecomm_cli("--socket", daemon.socket, "thresholds", "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)["boundaries"]


CALIBRATED_8KIB = [
    {"name": "oneshot_max_bytes", "value_bytes": 8 << 10, "source": "calibrated"},
    {"name": "service_min_bytes", "value_bytes": None, "source": "default"},
]
DEFAULT = [
    {"name": "oneshot_max_bytes", "value_bytes": DEFAULT_BOUNDARIES["cpu"]["oneshot_max_bytes"], "source": "default"},
    {"name": "service_min_bytes", "value_bytes": None, "source": "default"},
]


def test_measured_timings_are_placed_stored_and_reused_by_a_restarted_daemon(make_daemon, tmp_path):
    """The boundary the timings place is in force, stored with the medians bit for bit, and a
    daemon started on that state directory uses it without probing."""
    state = tmp_path / "state"
    keeper, store = _keeper(state)
    reply = asyncio.run(keeper.conclude("cpu", QUIET, store))
    assert list(reply.warnings) == []
    assert DispatchTable.from_proto(reply.thresholds).boundary("oneshot_max_bytes").describe() == (
        "oneshot_max_bytes=8KiB (calibrated)"
    )
    assert _reply_points(reply) == _points(QUIET.medians)
    stored = state / f"calibration-{reply.fingerprint_key}.json"
    assert reply.stored_at == str(stored)
    calibration = Calibration.from_json(stored.read_text())
    assert calibration.boundaries == {"oneshot_max_bytes": 8 << 10}
    assert calibration.medians == QUIET.medians and calibration.fingerprint == cpu_fingerprint()
    assert (_calibrations(keeper, "ok"), _calibrations(keeper, "noisy")) == (1.0, 0.0)

    daemon = make_daemon("--state-dir", str(state))
    assert _thresholds(daemon) == CALIBRATED_8KIB
    assert "calibration in force" in daemon.log() and "no stored calibration" not in daemon.log()


def test_timings_that_are_noise_are_refused_and_the_boundaries_in_force_stay(tmp_path):
    """A machine too busy to measure: the warning names the noise with its figures, the boundary
    calibrated before stays in force and its file is untouched."""
    state = tmp_path / "state"
    keeper, store = _keeper(state)
    calibrated = asyncio.run(keeper.conclude("cpu", QUIET, store))
    (stored,) = state.iterdir()
    before = stored.read_bytes()
    refused = asyncio.run(keeper.conclude("cpu", BUSY, store))
    (warning,) = refused.warnings
    assert warning.startswith(
        "calibration refused: 14 points were still noise after measuring again (is the machine busy?), so the cpu "
        "boundaries stay as they were and nothing was stored: oneshot at 1KiB: the probe's ranks had 30% of a core "
        "each (median 10.0 us); "
    ), warning
    assert warning.endswith("; and 8 more"), warning
    assert refused.stored_at == "nowhere: the measurements were noise" and refused.fingerprint_key == ""
    assert refused.thresholds == calibrated.thresholds
    assert keeper.preview("cpu", False).boundary("oneshot_max_bytes").describe() == (
        "oneshot_max_bytes=8KiB (calibrated)"
    )
    assert _reply_points(refused) == _points(BUSY.medians)
    assert list(state.iterdir()) == [stored] and stored.read_bytes() == before
    assert (_calibrations(keeper, "ok"), _calibrations(keeper, "noisy")) == (1.0, 1.0)


def _in_force_and_stored(
    result: subprocess.CompletedProcess, daemon: Daemon, state: Path, before: list[dict]
) -> dict | None:
    """Check a `nodecomm calibrate --json` through the daemon's real probe, whichever way it went,
    and return the stored calibration, or None where the probe's timings were refused as noise.

    On a machine shared with other work the probe's timings may be noise, which the daemon must
    refuse: a test of what calibrating does through the daemon takes either outcome and asserts
    each fully. Calibrated: the reply's boundaries are in force and stored. Refused: the warning
    names the noise, the boundaries `before` stay in force, nothing is stored."""
    document = json.loads(result.stdout[result.stdout.index("{") :])
    in_force = _thresholds(daemon)
    metrics = daemon.metrics_text()
    if result.returncode == 0:
        assert document["warnings"] == [], document["warnings"]
        assert document["boundaries"] == in_force and in_force[0]["source"] == "calibrated", in_force
        stored = state / f"calibration-{document['fingerprint_key']}.json"
        assert document["stored_at"] == str(stored)
        calibration = Calibration.from_json(stored.read_text())
        assert calibration.boundaries == {"oneshot_max_bytes": in_force[0]["value_bytes"]}
        assert 'nodecomm_calibrations_total{result="ok"} 1.0' in metrics
        return calibration
    assert result.returncode == 1, result.stderr + result.stdout
    (warning,) = document["warnings"]
    assert warning.startswith("calibration refused: ") and "points were still noise" in warning, warning
    assert "nothing was stored" in warning and " us" in warning, warning
    assert f"nodecomm calibrate: {warning}" in result.stderr
    assert document["stored_at"] == "nowhere: the measurements were noise"
    assert document["boundaries"] == before == in_force, (document["boundaries"], before, in_force)
    assert not list(state.glob("calibration-*.json"))
    assert 'nodecomm_calibrations_total{result="noisy"} 1.0' in metrics
    return None


def test_calibrate_probes_through_the_daemon_and_a_restarted_daemon_keeps_the_outcome(make_daemon, tmp_path):
    """`nodecomm calibrate` end to end, on whatever machine runs it: the probe times both paths
    at every size and the plot is drawn; what it placed (or, refused as noise, the defaults) is
    what a restarted daemon has, without probing."""
    state = tmp_path / "state"
    daemon = make_daemon("--state-dir", str(state))
    plot = tmp_path / "calibration.png"
    result = nodecomm_cli(
        "--socket", daemon.socket, "calibrate", "--min-bytes", "1KiB", "--max-bytes", "64KiB", "--json",
        "--plot", str(plot),
    )  # fmt: skip
    stored = _in_force_and_stored(result, daemon, state, DEFAULT)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads(result.stdout[result.stdout.index("{") :])
    assert [(p["path"], p["wire"], p["bytes"]) for p in document["points"]] == [
        (path, "lossless", size) for path in ("oneshot", "twoshot") for size in SIZES
    ]
    assert all(p["seconds"] > 0 for p in document["points"])
    in_force = document["boundaries"]

    daemon.stop()
    daemon.start()
    assert _thresholds(daemon) == in_force
    assert '"msg": "calibrated"' not in daemon.log()
    assert ("calibration in force" in daemon.log()) == (stored is not None)


@pytest.mark.parametrize(
    "where, writable, stored_at",
    [
        # A daemon refuses such a state_dir at start (test_config.py); this one appears later.
        ("a file where the state directory was", True, "nowhere: [Errno 17] File exists: '{state}'"),
        ("a store that writes nothing", False, "nowhere: this daemon writes no state"),
    ],
)
def test_a_calibration_that_is_not_stored_still_takes_effect(tmp_path, caplog, where, writable, stored_at):
    state = tmp_path / "state"
    keeper, store = _keeper(state, writable)
    if writable:
        state.write_text(where)
    with caplog.at_level(logging.ERROR, logger="nodecomm.tables"):
        reply = asyncio.run(keeper.conclude("cpu", QUIET, store))
    assert reply.stored_at == stored_at.format(state=state)
    assert keeper.preview("cpu", False).boundary("oneshot_max_bytes").describe() == (
        "oneshot_max_bytes=8KiB (calibrated)"
    )
    assert [r.getMessage() for r in caplog.records] == (["storing the calibration failed"] if writable else [])
    assert state.is_file() if writable else not state.exists()
    assert _calibrations(keeper, "ok") == 1.0


def test_a_new_fingerprint_is_probed_on_start_when_configured(make_daemon, tmp_path):
    state = tmp_path / "fresh"
    daemon = make_daemon("--state-dir", str(state), "--calibrate-on-start", "true")
    # The probe ends with its timings in force or, on a busy machine, refused as noise; either
    # is logged once the daemon has acted on it.
    ends = ('"msg": "calibration in force"', '"msg": "calibration refused: ', '"msg": "calibration on start failed')
    wait_until(
        lambda: any(end in daemon.log() for end in ends),
        240,
        lambda: f"the probe on start concluded; the daemon's log ends:\n{daemon.log()[-3000:]}",
    )
    log = daemon.log()
    assert "calibrating on start" in log and "calibration on start failed" not in log, log[-3000:]
    metrics = daemon.metrics_text()
    results = {r: f'nodecomm_calibrations_total{{result="{r}"}} 1.0' in metrics for r in ("ok", "noisy", "failed")}
    # Exactly one probe concluded, accepted or refused, and everything the daemon shows says which.
    assert list(results.values()).count(True) == 1 and not results["failed"], metrics
    calibrated = results["ok"]
    shown = nodecomm_cli("--socket", daemon.socket, "thresholds").stdout
    assert len(list(state.glob("calibration-*.json"))) == (1 if calibrated else 0)
    assert ('"msg": "calibrated"' in log) == calibrated and ("nothing was stored" in log) == (not calibrated), log
    assert ("(calibrated)" in shown) == calibrated, shown
    assert ("oneshot_max_bytes=32KiB (default)" in shown) == (not calibrated), shown


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass  # gone meanwhile
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_cancelled_calibration_stops_its_probe_and_its_ranks(make_daemon):
    daemon = make_daemon()
    pid = daemon.process.pid
    channel, stub = stub_for(daemon)
    with channel:
        request = pb.CalibrateRequest(device_kind="cpu", world_size=2, min_bytes=1024, max_bytes=64 << 20)
        call = stub.Calibrate(request, timeout=300)
        assert next(call).WhichOneof("kind") == "point"  # the probe and its ranks are running
        probe = _descendants(pid)
        assert len(probe) >= 3
        call.cancel()
        wait_until(lambda: not any(map(_alive, probe)), 30, "the probe's processes gone with the calibration")
    # The calibration lock was released with it: the next one runs to an end, calibrated or (on a
    # busy machine) refused as noise, and is not "already running".
    result = nodecomm_cli("--socket", daemon.socket, "calibrate", "--min-bytes", "1KiB", "--max-bytes", "2KiB")
    ran = result.returncode == 0 or (result.returncode == 1 and "calibration refused: " in result.stderr)
    assert ran and "already running" not in result.stderr, result.stderr + result.stdout


def test_probes_start_without_forking_a_busy_grpc_daemon():
    # Found in CI: a calibration probe died with SIGSEGV (exit -11) before it printed anything. The
    # daemon started it through uvloop, which fork()s the threaded daemon and runs gRPC's fork
    # handlers in the copy; under gRPC traffic about 4% of such copies crashed before exec.
    import asyncio

    import grpc
    import uvloop
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from nodecomm.service.calibration.probe import start_probe

    async def spawn_under_traffic(spawns: int) -> dict[int, int]:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        busy = True

        async def traffic() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                while busy:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)

        callers = [asyncio.create_task(traffic()) for _ in range(4)]
        codes: dict[int, int] = {}
        try:
            for _ in range(spawns):
                process = start_probe(["/bin/true"])
                process.stdout.close()
                code = await asyncio.to_thread(process.wait)
                codes[code] = codes.get(code, 0) + 1
        finally:
            busy = False
            await asyncio.gather(*callers)
            await server.stop(None)
        return codes

    assert uvloop.run(spawn_under_traffic(1000)) == {0: 1000}


def test_private_reads_state_and_keeps_its_own_calibration_in_the_users_cache(make_daemon, tmp_path):
    """A job's private daemon takes the node's stored calibration, and keeps what it probes in the
    user's cache (made 0700), never in the node's state: the user's next private daemon starts
    from the cache, the newer of the two, and its tables say so."""
    state, cache = tmp_path / "state", tmp_path / "cache"
    keeper, store = _keeper(state)
    asyncio.run(keeper.conclude("cpu", QUIET, store))  # the node daemon's calibration
    (stored,) = state.glob("calibration-*.json")
    before = stored.read_bytes()
    flags = ("--private", "true", "--private-grace-seconds", "60", "--state-dir", str(state), "--cache-dir", str(cache))
    private = make_daemon(*flags)
    with socket.socket(socket.AF_UNIX) as lease:  # a job's process holding the lease, as ranks do
        lease.connect(lease_socket_path(private.socket))
        assert _thresholds(private) == CALIBRATED_8KIB
        again = nodecomm_cli(
            "--socket", private.socket, "calibrate", "--min-bytes", "1KiB", "--max-bytes", "8KiB", "--json"
        )  # fmt: skip
        document = json.loads(again.stdout[again.stdout.index("{") :])
        in_force = _thresholds(private)
    assert [p.name for p in state.iterdir()] == [stored.name] and stored.read_bytes() == before
    if again.returncode != 0:  # a busy machine: nothing measured, nothing kept
        assert again.returncode == 1 and "calibration refused: " in again.stderr, again.stderr + again.stdout
        assert document["stored_at"] == "nowhere: the measurements were noise"
        assert document["boundaries"] == in_force == CALIBRATED_8KIB  # the node's stays in force
        return
    (kept,) = cache.glob("calibration-*.json")
    assert document["stored_at"] == str(kept) and document["warnings"] == [] and document["boundaries"] == in_force
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    private.stop()
    following = make_daemon(*flags)  # the user's next job
    assert f'"origin": "{kept}, measured ' in following.log()
    assert _thresholds(following) == in_force


def test_a_busy_machine_is_not_calibrated(make_daemon, tmp_path):
    """Busy processes on every core, each busy and idle for 1-10 ms in turn: noise at most sizes,
    twice, so the daemon keeps its boundaries, stores nothing and says why with the figures."""
    state = tmp_path / "state"
    daemon = make_daemon("--state-dir", str(state))
    bursts = (
        "import random, time\nwhile True:\n    t = time.monotonic()\n"
        "    while time.monotonic() - t < random.uniform(0.001, 0.01): pass\n    time.sleep(random.uniform(0.001, 0.01))"
    )
    spinners = [subprocess.Popen([sys.executable, "-c", bursts]) for _ in range(6 * os.cpu_count())]
    try:
        result = nodecomm_cli(
            "--socket", daemon.socket, "calibrate", "--min-bytes", "4KiB", "--max-bytes", "4MiB", "--json"
        )  # fmt: skip
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert result.returncode == 1, result.stdout + result.stderr
    document = json.loads(result.stdout[result.stdout.index("{") :])
    (warning,) = document["warnings"]
    assert warning.startswith("calibration refused: ") and "nothing was stored" in warning
    assert " us" in warning and any(figure in warning for figure in ("middle half spans", "x the ", "of a core each"))
    assert warning in result.stderr
    assert document["stored_at"] == "nowhere: the measurements were noise"
    assert not list(state.glob("calibration-*.json")) if state.exists() else True
    assert document["boundaries"][0]["source"] == "default"
    assert 'nodecomm_calibrations_total{result="noisy"} 1.0' in daemon.metrics_text()
    assert "calibration measured noise at most sizes; probing again" in daemon.log()


def test_noise_is_a_wide_middle_half_or_a_latency_that_falls_with_size():
    medians = {"oneshot": {4096: 10e-6, 8192: 12e-6}, "twoshot": {4096: 20e-6, 8192: 21e-6}}
    calm = {"oneshot": {4096: 0.2, 8192: 0.3}, "twoshot": {4096: 0.1, 8192: 0.1}}
    assert Measured(medians, calm).noise() == []
    wide = {**calm, "oneshot": {4096: 1.5, 8192: 0.3}}
    assert Measured(medians, wide).noise() == [
        "oneshot at 4KiB: its iterations' middle half spans 1.5x its median 10.0 us"
    ]
    falling = {**medians, "oneshot": {4096: 208e-6, 8192: 13e-6}}
    assert Measured(falling, calm).noise() == ["oneshot at 4KiB: 208.0 us, 16x the 13.0 us at 8KiB"]
    rising = {**medians, "twoshot": {4096: 13e-6, 8192: 282e-6}}
    assert Measured(rising, calm).noise() == ["twoshot at 4KiB: 13.0 us, 0.046x the 282.0 us at 8KiB"]


def test_a_point_measured_without_a_whole_core_is_noise():
    medians = {"oneshot": {4096: 10e-6, 8192: 12e-6}}
    calm = {"oneshot": {4096: 0.2, 8192: 0.3}}
    shares = {"oneshot": {4096: 0.22, 8192: 0.95}}
    assert Measured(medians, calm, shares).noise() == [
        "oneshot at 4KiB: the probe's ranks had 22% of a core each (median 10.0 us)"
    ]


def test_a_stored_calibration_keeps_the_variants_the_probe_saw():
    """The variant a path took per size (CUDA oneshot: push or pull), as the bench's rows carry it,
    is stored beside the medians and read back; a variant that is neither is refused, naming the
    field."""
    from nodecomm.tools.bench import Row

    rows = [
        dataclasses.asdict(Row(size, size // 4, "float32", path, 2.0, 3.0, 0.0, 0.0, 0, 10, 1.5, 2.5, 1.0, variant))
        for size, path, variant in ((1024, "oneshot", "push"), (1 << 20, "oneshot", "pull"), (1024, "twoshot", ""))
    ]
    measured = measured_from_rows(rows, "cuda")
    assert measured.variants == {"oneshot": {1024: "push", 1 << 20: "pull"}}
    assert measured.medians["twoshot"] == {1024: 2e-6} and measured.spreads["oneshot"][1024] == 0.5
    with pytest.raises(InternalError, match="the calibration probe's results are unreadable"):
        measured_from_rows([{"path": "oneshot"}], "cuda")

    medians = {p: _times([1e-6 * (i + 1) for i in range(7)]) for p in ("oneshot", "twoshot", "dma")}
    variants = {"oneshot": {size: "push" if size <= 8 << 10 else "pull" for size in SIZES}}
    calibration = calibration_from({"device_kind": "cuda"}, medians, variants)
    assert type(calibration).from_json(calibration.to_json()) == calibration
    assert calibration_from({"device_kind": "cuda"}, medians).variants == {}
    wrong = json.loads(calibration.to_json())
    wrong["variants"]["oneshot"]["1024"] = "sideways"
    with pytest.raises(InvalidCalibrationError, match=r"variants.oneshot.1024: 'sideways' is not one of"):
        type(calibration).from_json(json.dumps(wrong))
    again = Measured(medians, {}, variants={"oneshot": {1024: "pull"}})
    assert Measured(medians, {}, variants=variants).remeasured(again).variants["oneshot"][1024] == "pull"


def test_compressed_min_is_where_a_wire_wins_to_the_end_of_the_sweep():
    lossless = _times([1, 1, 1, 2, 4, 8, 16])
    assert compressed_min(SIZES, lossless, _times([2, 2, 0.9, 1, 2, 4, 8])) == 4 << 10  # wins from 4 KiB on
    assert compressed_min(SIZES, lossless, _times([2, 2, 2, 2, 2, 4, 8])) == 16 << 10
    assert compressed_min(SIZES, lossless, _times([2, 2, 2, 2, 4, 8, 15])) is None  # a tail of one: no evidence
    assert compressed_min(SIZES, lossless, _times([1.5, 1.5, 1.5, 3, 5, 9, 17])) is None  # never wins
    # The wire is compared with the path the calibrated boundaries give each size.
    medians = {"oneshot": _times([1] * 7), "twoshot": _times([5, 5, 5, 5, 2, 2, 2]),
               "oneshot+int8": _times([9] * 7), "twoshot+int8": _times([9, 9, 9, 9, 1, 1, 1]),
               "oneshot+fp8": _times([0.5] * 7), "twoshot+fp8": _times([9] * 7)}  # fmt: skip
    placed = wire_boundaries({"oneshot_max_bytes": 8 << 10}, "twoshot", medians, ["int8", "fp8"])
    assert placed == {"int8": 16 << 10, "fp8": None}


def test_a_group_that_asked_for_a_wire_gets_its_calibrated_boundary_and_no_other_group_does(tmp_path):
    keeper = TableKeeper(DaemonConfig(state_dir=str(tmp_path)), DaemonMetrics(), 16)
    medians = {p: _times([1e-6 * (i + 1) for i in range(7)]) for p in ("oneshot", "twoshot")}
    calibration = calibration_from(cpu_fingerprint(), medians)
    keeper.use_calibration(dataclasses.replace(calibration, wire_boundaries={"int8": 16 << 10, "fp8": None}), "test")
    int8 = keeper.for_new_group("cpu", False, {}, Wire.INT8)
    assert int8.boundary("compressed_min_bytes").describe() == "compressed_min_bytes=16KiB (calibrated)"
    assert int8.wire_for(16 << 10) is Wire.INT8 and int8.wire_for((16 << 10) - 1) is Wire.LOSSLESS
    fp8 = keeper.for_new_group("cpu", False, {}, Wire.FP8)
    assert fp8.boundary("compressed_min_bytes").value_bytes is None and fp8.wire_for(1 << 30) is Wire.LOSSLESS
    plain = keeper.for_new_group("cpu", False, {}, Wire.LOSSLESS)
    assert "compressed_min_bytes" not in {b.name for b in plain.boundaries} and not plain.range_wires


def test_a_wire_boundary_placed_from_timings_is_stored_and_given_to_groups_that_ask(tmp_path):
    state = tmp_path / "state"
    keeper, store = _keeper(state)
    reply = asyncio.run(keeper.conclude("cpu", QUIET_WITH_INT8, store, ["int8"]))
    assert list(reply.warnings) == [] and _reply_points(reply) == _points(QUIET_WITH_INT8.medians)
    calibration = Calibration.from_json((state / f"calibration-{reply.fingerprint_key}.json").read_text())
    assert calibration.boundaries == {"oneshot_max_bytes": 8 << 10}
    assert calibration.wire_boundaries == {"int8": 32 << 10} and calibration.medians == QUIET_WITH_INT8.medians
    int8 = keeper.for_new_group("cpu", False, {}, Wire.INT8)
    assert int8.boundary("compressed_min_bytes").describe() == "compressed_min_bytes=32KiB (calibrated)"
    fp8 = keeper.for_new_group("cpu", False, {}, Wire.FP8).boundary("compressed_min_bytes")
    assert (fp8.value_bytes, fp8.source) == (None, Source.DEFAULT)  # fp8 was not timed: off


def test_calibrating_a_wire_times_it_beside_lossless_and_stores_its_boundary(make_daemon, tmp_path):
    state = tmp_path / "state"
    daemon = make_daemon("--state-dir", str(state))
    result = nodecomm_cli(
        "--socket", daemon.socket, "calibrate", "--min-bytes", "4KiB", "--max-bytes", "64KiB", "--wire", "int8",
        "--json",
    )  # fmt: skip
    stored = _in_force_and_stored(result, daemon, state, DEFAULT)
    document = json.loads(result.stdout[result.stdout.index("{") :])
    rows = {(p["path"], p["wire"]) for p in document["points"]}
    assert rows == {("oneshot", "lossless"), ("twoshot", "lossless"), ("oneshot", "int8"), ("twoshot", "int8")}
    if stored is not None:
        assert set(stored.wire_boundaries) == {"int8"}
        assert {"oneshot+int8", "twoshot+int8"} <= set(stored.medians)
    assert [b["name"] for b in document["boundaries"]] == ["oneshot_max_bytes", "service_min_bytes"]  # lossless preview
    wrong = nodecomm_cli("--socket", daemon.socket, "calibrate", "--wire", "int4")
    assert wrong.returncode != 0 and "int4" in wrong.stderr + wrong.stdout


@pytest.mark.parametrize(
    "devices, links, dma_min, why",
    [
        ([0, 1], [[(1, 1, 0), (1, 0, 0)], [(1, 0, 0), (1, 1, 0)]], 6 << 20, None),  # PCIe peers
        ([0, 1], [[(1, 1, 0), (1, 1, 0)], [(1, 1, 0), (1, 1, 0)]], None, "NVLink between every pair of GPUs"),
        ([0, 0], [[(1, 1, 0)]], None, "ranks share a GPU"),
    ],
)  # fmt: skip
def test_the_built_in_cuda_default_follows_the_topology(tmp_path, devices, links, dma_min, why):
    """The copy engines lost at every size where peer reads are fast (docs/calibration-gpu.md): a
    group of ranks sharing a GPU, or of GPUs all NVLink-connected (peer access with native
    atomics), starts with dma off, and its table says why; PCIe peers keep 6 MiB, and a
    calibrated dma_min_bytes stays whatever the topology."""
    keeper, _ = _keeper(tmp_path)
    keeper.links = links
    table = keeper.for_new_group("cuda", False, {}, Wire.LOSSLESS, devices)
    assert table.boundary("dma_min_bytes") == Boundary("dma_min_bytes", dma_min, Source.DEFAULT)
    assert table.origin.startswith("built-in defaults") and (why is None or table.origin.endswith(why))
    keeper.calibrated["cuda"] = {"dma_min_bytes": 8 << 20}
    calibrated = keeper.for_new_group("cuda", False, {}, Wire.LOSSLESS, devices).boundary("dma_min_bytes")
    assert calibrated == Boundary("dma_min_bytes", 8 << 20, Source.CALIBRATED)
