"""Calibration: boundary placement from measurements, and the CPU probe end to end through the
daemon, persisted and reused by a restarted daemon without probing again."""

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from conftest import stub_for
from nodecomm.errors import InternalError
from nodecomm.service.calibration import (
    InvalidCalibrationError,
    Measured,
    calibration_from,
    compressed_min,
    cpu_fingerprint,
    cuda_boundaries,
    small_path_max,
    wire_boundaries,
)  # fmt: skip
from nodecomm.v1 import control_pb2 as pb
from test_cli import nodecomm_cli

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


def test_calibrate_persists_and_a_restarted_daemon_reuses_it(make_daemon, tmp_path):
    state = tmp_path / "state"
    daemon = make_daemon("--state-dir", str(state))
    plot = tmp_path / "calibration.png"
    result = nodecomm_cli(
        "--socket", daemon.socket, "calibrate", "--min-bytes", "1KiB", "--max-bytes", "64KiB", "--json",
        "--plot", str(plot),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads(result.stdout[result.stdout.index("{") :])
    boundary, service = document["boundaries"]
    assert boundary["name"] == "oneshot_max_bytes" and boundary["source"] == "calibrated"
    assert service == {"name": "service_min_bytes", "value_bytes": None, "source": "default"}
    assert {p["path"] for p in document["points"]} == {"oneshot", "twoshot"}
    assert len(document["points"]) == 2 * 7 and all(p["seconds"] > 0 for p in document["points"])
    stored = json.loads((state / f"calibration-{document['fingerprint_key']}.json").read_text())
    assert stored["boundaries"] == {"oneshot_max_bytes": boundary["value_bytes"]}
    shown = nodecomm_cli("--socket", daemon.socket, "thresholds").stdout
    assert "oneshot_max_bytes=" in shown and "(calibrated)" in shown
    metrics = daemon.metrics_text()
    assert 'nodecomm_calibrations_total{result="ok"} 1.0' in metrics

    daemon.stop()
    daemon.start()
    again = nodecomm_cli("--socket", daemon.socket, "thresholds", "--json").stdout
    assert json.loads(again)["boundaries"] == [
        {"name": "oneshot_max_bytes", "value_bytes": boundary["value_bytes"], "source": "calibrated"},
        service,
    ]
    assert "calibration in force" in daemon.log() and '"msg": "calibrated"' not in daemon.log()


def test_a_calibration_that_cannot_be_stored_still_takes_effect(make_daemon, tmp_path):
    state = tmp_path / "state"
    daemon = make_daemon("--state-dir", str(state))
    shutil.rmtree(state, ignore_errors=True)
    state.write_text("a file where the state directory was")
    result = nodecomm_cli(
        "--socket", daemon.socket, "calibrate", "--min-bytes", "1KiB", "--max-bytes", "4KiB", "--json"
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    document = json.loads(result.stdout[result.stdout.index("{") :])
    assert document["stored_at"].startswith("nowhere: ")
    assert document["boundaries"][0]["source"] == "calibrated"
    assert "(calibrated)" in nodecomm_cli("--socket", daemon.socket, "thresholds").stdout
    assert "storing the calibration failed" in daemon.log()
    assert 'nodecomm_calibrations_total{result="ok"} 1.0' in daemon.metrics_text()


def test_a_new_fingerprint_is_probed_on_start_when_configured(make_daemon, tmp_path):
    daemon = make_daemon("--state-dir", str(tmp_path / "fresh"), "--calibrate-on-start", "true")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and '"msg": "calibration in force"' not in daemon.log():
        time.sleep(0.5)
    assert "calibrating on start" in daemon.log() and '"msg": "calibrated"' in daemon.log()
    assert list((tmp_path / "fresh").glob("calibration-*.json"))
    shown = nodecomm_cli("--socket", daemon.socket, "thresholds").stdout
    assert "(calibrated)" in shown


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
        deadline = time.monotonic() + 30
        while any(map(_alive, probe)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, probe)), "the probe's processes outlived the calibration"
    # The calibration lock was released with it.
    result = nodecomm_cli("--socket", daemon.socket, "calibrate", "--min-bytes", "1KiB", "--max-bytes", "2KiB")
    assert result.returncode == 0, result.stderr + result.stdout


def test_probes_start_without_forking_a_busy_grpc_daemon():
    # Found in CI: a calibration probe died with SIGSEGV (exit -11) before it printed anything. The
    # daemon started it through uvloop, which fork()s the threaded daemon and runs gRPC's fork
    # handlers in the copy; under gRPC traffic about 4% of such copies crashed before exec.
    import asyncio

    import grpc
    import uvloop
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from nodecomm.service.calibration import start_probe

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


def test_private_reads_state_writes_none(make_daemon, tmp_path):
    """A job's private daemon takes the node's stored calibration and stores none of its own."""
    state = tmp_path / "state"
    node = make_daemon("--state-dir", str(state))
    first = nodecomm_cli("--socket", node.socket, "calibrate", "--min-bytes", "1KiB", "--max-bytes", "4KiB", "--json")
    assert first.returncode == 0, first.stderr + first.stdout
    node.stop()
    (stored,) = state.glob("calibration-*.json")
    before = stored.read_bytes()
    private = make_daemon("--private", "true", "--private-grace-seconds", "60", "--state-dir", str(state))
    with socket.socket(socket.AF_UNIX) as lease:  # a job's process holding the lease, as ranks do
        lease.connect(private.socket + ".lease")
        assert "(calibrated)" in nodecomm_cli("--socket", private.socket, "thresholds").stdout
        again = nodecomm_cli(
            "--socket", private.socket, "calibrate", "--min-bytes", "1KiB", "--max-bytes", "8KiB", "--json"
        )  # fmt: skip
        assert again.returncode == 0, again.stderr + again.stdout
        document = json.loads(again.stdout[again.stdout.index("{") :])
    assert document["stored_at"] == "nowhere: a job's private daemon writes no state"
    assert [p.name for p in state.iterdir()] == [stored.name] and stored.read_bytes() == before


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


def test_a_stored_calibration_keeps_the_forms_the_probe_saw():
    """The form a path took per size (CUDA oneshot: push or pull) is stored beside the medians and
    read back; a form that is neither is refused, naming the field."""
    medians = {p: _times([1e-6 * (i + 1) for i in range(7)]) for p in ("oneshot", "twoshot", "dma")}
    forms = {"oneshot": {size: "push" if size <= 8 << 10 else "pull" for size in SIZES}}
    calibration = calibration_from({"device_kind": "cuda"}, medians, forms)
    assert type(calibration).from_json(calibration.to_json()) == calibration
    assert calibration_from({"device_kind": "cuda"}, medians).forms == {}
    wrong = json.loads(calibration.to_json())
    wrong["forms"]["oneshot"]["1024"] = "sideways"
    with pytest.raises(InvalidCalibrationError, match=r"forms.oneshot.1024: 'sideways' is not one of"):
        type(calibration).from_json(json.dumps(wrong))
    again = Measured(medians, {}, forms={"oneshot": {1024: "pull"}})
    assert Measured(medians, {}, forms=forms).remeasured(again).forms["oneshot"][1024] == "pull"


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
    from nodecomm.service.config import DaemonConfig
    from nodecomm.service.metrics import DaemonMetrics
    from nodecomm.service.tables import TableKeeper
    from nodecomm.thresholds import Wire

    keeper = TableKeeper(DaemonConfig(state_dir=str(tmp_path)), DaemonMetrics(), 16)
    medians = {p: _times([1e-6 * (i + 1) for i in range(7)]) for p in ("oneshot", "twoshot")}
    calibration = calibration_from(cpu_fingerprint(), medians)
    keeper.use_calibration(dataclasses.replace(calibration, wire_boundaries={"int8": 16 << 10, "fp8": None}))
    int8 = keeper.for_new_group("cpu", False, {}, Wire.INT8)
    assert int8.boundary("compressed_min_bytes").describe() == "compressed_min_bytes=16KiB (calibrated)"
    assert int8.wire_for(16 << 10) is Wire.INT8 and int8.wire_for((16 << 10) - 1) is Wire.LOSSLESS
    fp8 = keeper.for_new_group("cpu", False, {}, Wire.FP8)
    assert fp8.boundary("compressed_min_bytes").value_bytes is None and fp8.wire_for(1 << 30) is Wire.LOSSLESS
    plain = keeper.for_new_group("cpu", False, {}, Wire.LOSSLESS)
    assert "compressed_min_bytes" not in {b.name for b in plain.boundaries} and not plain.range_wires


def test_calibrating_a_wire_times_it_beside_lossless_and_stores_its_boundary(make_daemon, tmp_path):
    state = tmp_path / "state"
    daemon = make_daemon("--state-dir", str(state))
    result = nodecomm_cli(
        "--socket", daemon.socket, "calibrate", "--min-bytes", "4KiB", "--max-bytes", "64KiB", "--wire", "int8",
        "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    document = json.loads(result.stdout[result.stdout.index("{") :])
    rows = {(p["path"], p["wire"]) for p in document["points"]}
    assert rows == {("oneshot", "lossless"), ("twoshot", "lossless"), ("oneshot", "int8"), ("twoshot", "int8")}
    stored = json.loads((state / f"calibration-{document['fingerprint_key']}.json").read_text())
    assert set(stored["wire_boundaries"]) == {"int8"}
    assert {"oneshot+int8", "twoshot+int8"} <= set(stored["medians"])
    assert [b["name"] for b in document["boundaries"]] == ["oneshot_max_bytes", "service_min_bytes"]  # lossless preview
    wrong = nodecomm_cli("--socket", daemon.socket, "calibrate", "--wire", "int4")
    assert wrong.returncode != 0 and "int4" in wrong.stderr + wrong.stdout
