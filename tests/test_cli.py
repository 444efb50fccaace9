"""The nodecomm command against a running daemon, and timings reaching its metrics."""

import contextlib
import itertools
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

import ranks
from nodecomm.tools.convergence_bench import converged_at
from waiting import wait_until


def nodecomm_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The CLI with `args`, in this environment and `env`."""
    return subprocess.run(
        [sys.executable, "-c", "import sys; from nodecomm.tools.cli import main; sys.exit(main())", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=None if env is None else {**os.environ, **env},
    )


def test_status_and_thresholds_show_a_live_group(daemon, spawn_ranks):
    report = mp.get_context("spawn").Queue()
    group = spawn_ranks(ranks.reduce_until_error, 2, 2, daemon.socket, "shown", report, timeout=120)
    for _ in range(2):
        report.get(timeout=60)
    status = nodecomm_cli("--socket", daemon.socket, "status", "--json")
    assert status.returncode == 0, status.stderr
    document = json.loads(status.stdout)
    assert document["health"] == "SERVING"
    (shown,) = document["groups"]
    assert shown["name"] == "shown" and shown["state"] == "active" and shown["live_ranks"] == [0, 1]
    assert shown["reserved_bytes"] > 2 * shown["capacity_bytes"]
    assert shown["paths"] == "oneshot <=32KiB, twoshot" and shown["topk_exchanges"] == 0
    human = nodecomm_cli("--socket", daemon.socket, "status")
    assert "shown" in human.stdout and "active" in human.stdout and "oneshot <=32KiB, twoshot" in human.stdout
    table = nodecomm_cli("--socket", daemon.socket, "thresholds", "--group", "shown", "--json")
    assert json.loads(table.stdout)["boundaries"][0]["name"] == "oneshot_max_bytes"
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5).read().decode()
    assert 'nodecomm_groups{state="active"} 1.0' in metrics
    assert "nodecomm_ranks 2.0" in metrics
    group.kill(0)
    group.results()


def test_status_columns_stay_aligned_past_a_long_group_name(daemon, spawn_ranks):
    context = mp.get_context("spawn")
    names = ["a", "torch.bdd70a8dccb3.0/cpu-a-name-past-the-old-columns"]
    report, commands = context.Queue(), [context.Queue() for _ in names]
    groups = [
        spawn_ranks(ranks.hold_named_group, 1, 1, daemon.socket, name, report, [queue], timeout=120)
        for name, queue in zip(names, commands, strict=True)
    ]
    for _ in names:
        report.get(timeout=60)
    shown = nodecomm_cli("--socket", daemon.socket, "status")
    lines = shown.stdout.splitlines()
    assert shown.returncode == 0, shown.stderr
    header = next((line for line in lines if line.startswith("group")), None)
    assert header, shown.stdout
    rows = [next(line for line in lines if line.startswith(name + " ")) for name in names]
    assert {row.index(" active") + 1 for row in rows} == {header.index("state")}, lines
    for queue in commands:
        queue.put("stop")
    for group in groups:
        group.values()


def test_status_json_without_a_daemon_is_json(tmp_path):
    result = nodecomm_cli("--socket", str(tmp_path / "nothing.sock"), "status", "--json")
    assert result.returncode == 1
    document = json.loads(result.stdout)
    assert document["health"] == "UNREACHABLE" and document["groups"] == []
    assert "nothing serves at" in document["error"], document


def test_captured_sizes_show_beside_the_table_in_status_and_metrics(daemon, spawn_ranks):
    """What the ranks' sessions report of their captured sizes: each with the path its graphs
    replay on and the path the table gives it now, in `nodecomm status` (a line for those that
    differ) and in nodecomm_captured_sizes."""
    context = mp.get_context("spawn")
    report, commands = context.Queue(), [context.Queue() for _ in range(2)]
    group = spawn_ranks(ranks.report_captured_sizes, 2, 2, daemon.socket, report, commands, timeout=120)
    for _ in range(2):
        assert report.get(timeout=60) == "sent"

    def shown() -> list:
        status = nodecomm_cli("--socket", daemon.socket, "status", "--json")
        return json.loads(status.stdout)["groups"][0]["captured"]

    wait_until(lambda: shown() != [], timeout=30, what="the captured sizes reach the daemon")
    assert shown() == [
        {"bytes": 4096, "path": "oneshot", "table_path": "oneshot"},
        {"bytes": 65536, "path": "oneshot", "table_path": "twoshot"},
    ]
    human = nodecomm_cli("--socket", daemon.socket, "status").stdout
    assert (
        "captured on a path the table no longer gives (re-capture to move): 64KiB on oneshot (table: twoshot)" in human
    )
    metrics = daemon.metrics_text()
    assert 'nodecomm_captured_sizes{group="captured",path="oneshot",table_path="oneshot"} 1.0' in metrics
    assert 'nodecomm_captured_sizes{group="captured",path="oneshot",table_path="twoshot"} 1.0' in metrics
    for queue in commands:
        queue.put("stop")
    group.values()
    wait_until(
        lambda: "nodecomm_captured_sizes{" not in daemon.metrics_text(), timeout=30, what="the group's series go"
    )


def test_sampled_timings_reach_the_daemon(make_daemon, spawn_ranks):
    daemon = make_daemon("--timing-sample-period", "1")
    spawn_ranks(ranks.join_only, 2, 2, daemon.socket, "timed", {}).values()
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5).read().decode()
    sampled = [line for line in metrics.splitlines() if line.startswith("nodecomm_sampled_operations_total{")]
    assert any('path="oneshot"' in line and float(line.split()[-1]) >= 2 for line in sampled), sampled
    assert "nodecomm_operation_seconds_bucket" in metrics


def test_threshold_override_reaches_ranks(make_daemon, spawn_ranks):
    daemon = make_daemon(env={"NODECOMM_ONESHOT_MAX_BYTES": "off"})
    table = nodecomm_cli("--socket", daemon.socket, "thresholds")
    assert "oneshot_max_bytes=off (override)" in table.stdout
    seen = spawn_ranks(ranks.misuse, 2, 2, daemon.socket).values()[0]
    assert seen["table"] == [(0, None, "twoshot")]


def test_bench_smoke_prints_the_table_and_json(tmp_path):
    """Rows print size by size as they are measured; the run's private daemon leaves no folder."""
    out, temporary = tmp_path / "bench.json", tmp_path / "tmp"
    temporary.mkdir()
    command = [sys.executable, "-c", "import sys; from nodecomm.tools.cli import main; sys.exit(main())"]
    command += [
        "bench",
        "--world-size",
        "2",
        "--min-bytes",
        "1KiB",
        "--max-bytes",
        "4KiB",
        "--json",
        str(out),
        "--progress",
    ]
    bench = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(temporary)}
    )
    lines, running_at_first_row = [], None
    for line in bench.stdout:
        lines.append(line)
        if running_at_first_row is None and line.split()[:1] == ["1KiB"]:
            running_at_first_row = bench.poll() is None and not any(line.startswith("# dispatch") for line in lines)
    bench.wait(timeout=300)
    result = subprocess.CompletedProcess(command, bench.returncode, "".join(lines), bench.stderr.read())
    assert result.returncode == 0, result.stderr
    assert '"level": "error"' not in result.stderr, result.stderr  # its daemon stops quietly too
    assert running_at_first_row, "the first rows printed only at the end"
    assert list(temporary.iterdir()) == [], "the bench's private daemon left its folder"
    assert "busbw(GB/s)" in result.stdout and "gloo" in result.stdout
    document = json.loads(out.read_text())
    rows = document["rows"]
    paths = ["oneshot", "twoshot", "service", "auto", "gloo"]
    assert [(r["size_bytes"], r["path"]) for r in rows] == [(s, p) for s in (1024, 2048, 4096) for p in paths]
    assert all(r["wrong"] == 0 and r["p50_us"] > 0 for r in rows)
    # Measured in the reverse order and the given one, size by size. Rank 0 prints these while the
    # bench prints its rows: two processes on one pipe, so a line is looked for anywhere.
    measured = [json.loads(found) for found in re.findall(r'\{"progress": (\{[^{}]*\})\}', result.stdout)]
    assert [(p["size_bytes"], p["path"]) for p in measured] == [
        (s, p) for i, s in enumerate((1024, 2048, 4096)) for p in (paths if i % 2 else paths[::-1])
    ]
    (note,) = document["notes"]
    assert note.startswith("service path control plane: an empty submit") and note in result.stdout
    after = result.stdout.split("(below 1: auto beat every single path's median)\n")[1].splitlines()
    regret = list(itertools.takewhile(lambda line: line.startswith("#   "), after))  # a NOISE note may follow
    assert [line.split()[1] for line in regret] == ["1KiB", "2KiB", "4KiB"]


def test_dispatch_regret_divides_auto_by_the_best_other_path():
    from nodecomm.tools.bench import Row
    from nodecomm.tools.bench_report import dispatch_regret

    def row(size: int, path: str, p50: float) -> Row:
        return Row(size, size // 4, "float32", path, p50, p50, 0.0, 0.0, 0, 10, p50, p50)

    rows = [row(1024, "oneshot", 4.0), row(1024, "nccl", 8.0), row(1024, "auto", 5.0)]
    rows += [row(2048, "oneshot", 9.0), row(2048, "nccl", 6.0), row(2048, "auto", 6.0), row(4096, "oneshot", 1.0)]
    assert dispatch_regret(rows) == [
        "# dispatch regret: auto p50 / best single path p50 per size (below 1: auto beat every single path's median)",
        "#        1KiB  1.250  best oneshot",
        "#        2KiB  1.000  best nccl",
    ]
    assert dispatch_regret([row(1024, "oneshot", 4.0)]) == []
    # auto against the baseline alone says nothing of the table: no single path of nodecomm's ran
    assert dispatch_regret([row(1024, "auto", 5.0), row(1024, "gloo", 400.0), row(1024, "torch", 8.0)]) == []


def test_topk_bench_compares_tables_with_the_baseline():
    result = nodecomm_cli(
        "bench", "--op", "topk", "--world-size", "3", "--rows", "0,5,64", "--topk", "8", "--iterations", "2"
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if not line.startswith("#")]
    assert [r[0] for r in rows] == ["0", "5", "64"] and all(r[-1] == "yes" for r in rows)


def test_a_bench_without_its_baseline_says_why():
    result = nodecomm_cli("bench", "--sizes", "1KiB", "--paths", "oneshot", "--no-baseline")
    assert result.returncode == 0, result.stderr
    assert "# no gloo baseline in this run (--no-baseline)" in result.stdout.splitlines(), result.stdout
    assert "# through a private daemon of its own (--socket S for another)" in result.stdout.splitlines()


def test_topk_merge_bench_compares_sets_with_the_gathered_merge():
    """Every size's sets equal the gathered merge's; 0 rows is a merge of nothing."""
    result = nodecomm_cli(
        "bench", "--op", "topk-merge", "--world-size", "3", "--rows", "0,5,40", "--topk", "8", "--iterations", "2"
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if not line.startswith("#")]
    assert [r[0] for r in rows] == ["0", "5", "40"] and all(r[-1] == "yes" for r in rows), result.stdout


def test_convergence_bench_reports_when_auto_reached_the_best_path_and_stayed():
    """A private daemon exploring every 4th call, from a stored table that sends every size to
    twoshot: a row per size with the best single path, the path in force at the end, the call (a
    whole window's) from which the table gave the size that path, the one from which auto stayed
    within 5% of the best (or never), and auto's last windows against the best."""
    result = nodecomm_cli(
        "bench", "--op", "convergence", "--sizes", "4KiB,256KiB", "--calls", "300", "--explore-period", "4",
        "--table", "twoshot",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "daemon flags: --explore-period 4 start: every size to twoshot (stored)" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if not line.startswith("#")]
    assert [row[0] for row in rows] == ["4KiB", "256KiB"], rows
    for _size, best, best_us, table, on_path, seconds, within, within_seconds, last in rows:
        assert best in ("oneshot", "twoshot") and table in ("oneshot", "twoshot") and float(best_us) > 0
        assert int(on_path) % 50 == 0 and float(seconds) >= 0
        assert within == "never" or int(within) % 50 == 0 and float(within_seconds) >= 0
        assert float(last) > 0
    refused = nodecomm_cli("--socket", "/nowhere", "bench", "--op", "convergence", "--table", "dma")
    assert refused.returncode == 2 and "--table starts a daemon of its own" in refused.stderr


def test_convergence_is_where_auto_comes_within_five_percent_and_stays():
    """By the median of 5 windows: one slow window does not count, a slow stretch does."""
    assert converged_at([2.0] * 5 + [1.0] * 10, 1.0) == 7
    assert converged_at([1.0] * 4 + [3.0] + [1.0] * 4, 1.0) == 0
    assert converged_at([1.0] * 5 + [2.0] * 3 + [1.0] * 5, 1.0) == 10
    assert converged_at([1.0] * 5 + [1.2] * 3, 1.0) is None


def test_across_nodes_bench_times_every_form_beside_gloo():
    """Two stand-in nodes (a private daemon each) of 2 and 1 ranks: a row per size with auto, flat,
    sharded and gloo, and the table the group's probe chose."""
    result = nodecomm_cli(
        "bench", "--op", "across-nodes", "--nodes", "2,1", "--sizes", "1KiB,64KiB", "--iterations", "3"
    )
    assert result.returncode == 0, result.stderr
    assert "nodes=2x1" in result.stdout and "world_size=3" in result.stdout
    assert any(line.startswith("# table: ") and "(probe" in line for line in result.stdout.splitlines())
    rows = [line.split() for line in result.stdout.splitlines() if not line.startswith("#")]
    assert [row[0] for row in rows] == ["1024", "65536"]
    assert all(float(cell) > 0 for row in rows for cell in row[1:]), rows


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--op", "across-nodes", "--nodes", "2"), "--nodes 2: expected two or more rank counts"),
        (("--op", "across-nodes", "--nodes", "2,0"), "argument --nodes: '2,0': expected every number to be 1 or more"),
        (("--op", "topk", "--rows", "64,many"), "argument --rows: '64,many': expected comma-separated whole numbers"),
        (("--op", "wire-error", "--worlds", "2,3"), "--worlds 2,3: expected divisors of 8"),
        (("--sizes", "3"), "--sizes 3: expected multiples of 4 bytes (one float32 element)"),
        (("--sizes", "5", "--dtype", "bfloat16"), "--sizes 5: expected multiples of 2 bytes (one bfloat16 element)"),
        (("--sizes", "off"), "argument --sizes: 'off': expected a size of at least 1 byte, e.g. 4KiB"),
        (("--sizes", "-4KiB"), "argument --sizes: '-4KiB': expected a size of at least 1 byte"),
        (("--min-bytes", "-1"), "argument --min-bytes: '-1': expected a size of at least 1 byte"),
        (("--sizes", "1KiB,99999GiB"), "--sizes 99999GiB: 2 ranks need about 999990.0 GiB for it (5x the size a rank)"),
    ],
)
def test_bench_refuses_bad_counts_and_says_what_it_expected(flags, says):
    result = nodecomm_cli("bench", *flags)
    assert result.returncode == 2 and says in result.stderr, result.stderr


def test_reflection_and_tcp_listener_on_loopback(make_daemon):
    import grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    from conftest import free_port
    from nodecomm.v1 import control_pb2 as pb
    from nodecomm.v1 import control_pb2_grpc as pb_grpc

    port = free_port()
    daemon = make_daemon("--tcp-address", f"127.0.0.1:{port}")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {"nodecomm.v1.Control", "grpc.health.v1.Health"} <= services
        assert pb_grpc.ControlStub(channel).ListGroups(pb.ListGroupsRequest(), timeout=5).groups == []
    assert daemon.healthy()


def test_cuda_tables_for_new_groups(make_daemon):
    """The built-in CUDA table (no GPU needed to ask): oneshot, then NCCL or twoshot, then DMA from
    6 MiB; an override moves a boundary for CUDA groups too."""
    daemon = make_daemon(env={"NODECOMM_DMA_MIN_BYTES": "16MiB"})
    plain = json.loads(nodecomm_cli("--socket", daemon.socket, "thresholds", "--device", "cuda", "--json").stdout)
    assert [(r["to"], r["path"]) for r in plain["ranges"]] == [
        (256 << 10, "oneshot"),
        ((16 << 20) - 1, "twoshot"),
        (None, "dma"),
    ]
    shown = nodecomm_cli("--socket", daemon.socket, "thresholds", "--device", "cuda").stdout
    assert ">256KiB and <16MiB" in shown and ">=16MiB" in shown and "16777215" not in shown
    with_nccl = nodecomm_cli("--socket", daemon.socket, "thresholds", "--device", "cuda", "--nccl")
    assert "new CUDA groups with an NCCL group" in with_nccl.stdout
    assert "-> nccl" in with_nccl.stdout and "dma_min_bytes=16MiB (override)" in with_nccl.stdout


def test_status_spells_each_range_by_the_boundary_that_ends_it():
    from nodecomm.thresholds import Boundary, Path, Source, build_table
    from nodecomm.tools.daemon_commands import _paths_summary

    values = {"oneshot_max_bytes": 256 << 10, "twoshot_max_bytes": None, "dma_min_bytes": 6 << 20}
    boundaries = {name: Boundary(name, value, Source.DEFAULT) for name, value in values.items()}
    assert _paths_summary(build_table(boundaries, Path.TWOSHOT, 0).to_proto()) == "oneshot <=256KiB, twoshot <6MiB, dma"
    boundaries["oneshot_max_bytes"] = Boundary("oneshot_max_bytes", 1000, Source.OVERRIDE)
    assert _paths_summary(build_table(boundaries, Path.NCCL, 0).to_proto()) == "oneshot <=1000, nccl <6MiB, dma"


def test_a_reader_that_stops_early_gets_no_traceback(daemon):
    """`nodecomm status | head -1`: the command stops quietly, status 0, when the pipe closes (here
    the reader is gone before the command writes)."""
    command = f"{sys.executable} -c 'import sys; from nodecomm.tools.cli import main; sys.exit(main())'"
    pipeline = f"set -o pipefail; {command} --socket {daemon.socket} status | true"
    finished = subprocess.run(["bash", "-c", pipeline], capture_output=True, text=True, timeout=60)
    assert finished.returncode == 0 and finished.stderr == "", finished.stderr


# Each a usage error, answered before any daemon or rank starts (exit 2, one line naming the argument).
BAD_ARGUMENTS = {
    ("--timeout", "0", "status"): "argument --timeout: '0': expected a number of seconds greater than 0",
    ("--timeout", "-1", "status"): "argument --timeout: '-1': expected a number of seconds greater than 0",
    ("bench", "--world-size", "0"): "argument --world-size: '0': expected a whole number from 1 to 16",
    ("bench", "--world-size", "-1"): "argument --world-size: '-1': expected a whole number from 1 to 16",
    ("bench", "--world-size", "17"): "argument --world-size: '17': expected a whole number from 1 to 16",
    ("bench", "--min-bytes", "1MiB", "--max-bytes", "4KiB"): "--min-bytes 1048576 is larger than --max-bytes 4096",
    ("bench", "--paths", "bogus"): "--paths bogus: expected some of oneshot, twoshot, service, auto, torch",
    ("bench", "--paths", "dma"): "--paths dma: expected some of oneshot, twoshot, service, auto, torch, inplace, gloo",
    ("bench", "--capacity", "10"): "--capacity 10: expected at least 64 bytes",
    ("bench", "--sizes", "abc"): "argument --sizes: 'abc': expected a size of at least 1 byte, e.g. 4KiB",
    ("calibrate", "--world-size", "0"): "argument --world-size: '0': expected a whole number from 2 to 16",
    ("calibrate", "--min-bytes", "1MiB", "--max-bytes", "4KiB"): "--min-bytes 1048576 is larger than --max-bytes",
    ("thresholds", "--nccl"): "--nccl applies to --device cuda",
}


@pytest.mark.parametrize("argv", list(BAD_ARGUMENTS), ids=" ".join)
def test_bad_arguments_are_usage_errors_before_anything_starts(argv):
    with _bench_temporary() as temporary:
        refused = nodecomm_cli(*argv, env={"TMPDIR": temporary})
        assert refused.returncode == 2 and BAD_ARGUMENTS[argv] in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        assert not os.listdir(temporary)  # no private daemon was started


def _interrupted(
    command: list[str], wait_for: str | Callable[[], object], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`command` (in this environment and `env`) in a process group of its own, sent Ctrl-C's
    SIGINT (to the whole group, as a terminal does) once it printed a line holding `wait_for`, or
    once `wait_for()` is true."""
    # As a terminal runs it: a test run started in the background of a script (`&`) ignores
    # SIGINT, and a child inherits an ignored signal, which Python then leaves ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        if callable(wait_for):
            ready = wait_until(lambda: wait_for() or process.poll() is not None, 60, "the moment to interrupt")
        else:
            while (ready := process.stdout.readline()) and wait_for not in ready:
                pass
        if ready and process.poll() is None:  # else it ended first: the caller sees how
            os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=120)
        # Its pipes close with it, unless a process it started lives on holding them.
        out, err = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _interrupted_calibration(command: list[str], moment: str) -> subprocess.CompletedProcess | None:
    """`command`, a calibration, interrupted at `moment`; None while the daemon refuses it as
    already running (it cancels the one interrupted before a moment after that one's client left)."""
    calibrate = _interrupted(command, moment)
    return None if "a calibration is already running" in calibrate.stderr else calibrate


def test_ctrl_c_ends_bench_and_calibrate_with_one_line_and_exit_130(daemon, tmp_path):
    """Ctrl-C in the middle of a bench (its ranks and its private daemon in the same group) and of
    a calibration: exit 130, one line on stderr, no traceback, no bench directory left."""
    cli = [sys.executable, "-m", "nodecomm.tools.cli"]
    # While its daemon starts, held in its first import for a minute: the daemon, in a session of
    # its own, ran on, refilled the directory the bench had removed and held the bench's pipes.
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import time\nif b'nodecomm.service' in open('/proc/self/cmdline', 'rb').read():\n    time.sleep(60)\n"
    )
    with _bench_temporary() as temporary:

        def daemon_started() -> bool:
            if not processes_naming(temporary):
                return False
            time.sleep(0.5)  # past its start: the bench is waiting for it to serve
            return True

        for sizes, moment, env in (
            ("1KiB,64MiB", "#wrong", {}),  # at once: making its directory, starting its daemon
            ("1KiB", daemon_started, {"PYTHONPATH": str(slow)}),
            ("1KiB,64MiB", "1KiB", {}),  # the first row: its ranks run (its daemon logged to stderr)
        ):
            bench = _interrupted(
                [*cli, "bench", "--sizes", sizes, "--paths", "oneshot,twoshot"], moment, {"TMPDIR": temporary, **env}
            )
            assert (bench.returncode, bench.stderr) == (130, "nodecomm bench: interrupted\n"), (moment, bench.stderr)
            assert not processes_naming(temporary) and not os.listdir(temporary), moment
    # As the call is set up and while it streams: both hung now and then when Ctrl-C landed inside
    # gRPC, or when the kernel handed SIGINT to one of gRPC's threads.
    calibrate_command = [*cli, "--socket", daemon.socket, "calibrate", "--max-bytes", "64MiB"]
    for moment in ("calibrating", "measured", "calibrating"):
        interrupted = partial(_interrupted_calibration, calibrate_command, moment)
        calibrate = wait_until(interrupted, 60, "a calibration the daemon does not refuse as already running")
        assert (calibrate.returncode, calibrate.stderr) == (130, "nodecomm calibrate: interrupted\n"), calibrate.stderr
    assert daemon.healthy()


def test_ctrl_c_inside_a_step_that_must_not_be_cut_comes_after_it():
    """interrupts_held (a daemon's Popen, the bench's directory made): SIGINT inside the block is
    KeyboardInterrupt at its end, on the main thread; on another thread the block runs as it is."""
    script = """
import os, signal, threading
from nodecomm.client.daemon_process import interrupts_held
done = []
try:
    with interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)
        done.append("block")
except KeyboardInterrupt:
    done.append("KeyboardInterrupt")
def off_main():
    with interrupts_held():
        done.append("thread")
thread = threading.Thread(target=off_main)
thread.start()
thread.join()
print(done)
"""
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert ran.stdout.strip() == "['block', 'KeyboardInterrupt', 'thread']", ran.stdout + ran.stderr


def test_a_killed_bench_leaves_no_daemon_and_no_directory():
    """SIGKILL to a running bench (and to its ranks): its private daemon, whose lease the bench
    held, leaves within seconds and takes its directory with it, and the state and cache the
    bench keeps there (a table learned from live timings goes to the cache)."""
    command = [sys.executable, "-m", "nodecomm.tools.cli", "bench", "--sizes", "1KiB,64MiB", "--paths", "oneshot"]
    with _bench_temporary() as temporary:
        bench = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": temporary},
        )
        try:
            while "1KiB" not in bench.stdout.readline():  # the first row: the daemon and the ranks run
                assert bench.poll() is None
            (directory,) = Path(temporary).iterdir()
            (directory / "cache").mkdir(exist_ok=True)
            (directory / "cache" / "calibration-learned.json").write_text("{}")
        finally:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
        wait_until(
            lambda: not directory.exists() and not processes_naming(directory),
            30,
            lambda: f"the bench's daemon and directory gone ({directory.exists()=}, {processes_naming(directory)=})",
        )


@contextlib.contextmanager
def _bench_temporary() -> Iterator[str]:
    """A temporary directory of the test's own for the benches it starts (their TMPDIR), short
    enough for a socket path: other benches on the machine do not show in it."""
    temporary = tempfile.mkdtemp(dir="/tmp", prefix="nc-test-")
    try:
        yield temporary
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def processes_naming(directory: Path | str) -> list[str]:
    """The command lines of the processes whose arguments name `directory` (its daemon's)."""
    found = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = path.read_bytes()
        except OSError:
            continue
        if str(directory).encode() in command:
            found.append(command.replace(b"\0", b" ").decode(errors="replace"))
    return found


def test_the_bench_says_when_its_figures_are_noise():
    """calibrate's noise guard on the bench's own rows: a quiet run's rows pass; a point whose ranks
    had a tenth of a core (oneshot 205 us where auto, on the same path, took 1.4 us) is named."""
    from nodecomm.tools.bench import Row
    from nodecomm.tools.bench_report import format_trailer

    def row(path: str, p50: float, share: float = 0.9) -> Row:
        return Row(1024, 256, "float32", path, p50, p50 * 1.2, 1.0, 1.0, 0, 100, p50 * 0.9, p50 * 1.1, share)

    # gloo's and the service path's ranks wait in the kernel: a small share of a core is theirs on a quiet machine.
    quiet = [row("oneshot", 1.5), row("auto", 1.4), row("gloo", 400.0, share=0.05), row("service", 90.0, share=0.1)]
    assert not any("NOISE" in line for line in format_trailer(quiet, device="cpu"))
    busy = [row("oneshot", 205.1, share=0.1), row("auto", 1.4), row("gloo", 400.0)]
    trailer = format_trailer(busy, device="cpu")
    assert "# NOISE: 1 point(s) whose timings varied too much to compare paths" in "\n".join(trailer), trailer
    assert any("oneshot at 1KiB: the probe's ranks had 10% of a core each" in line for line in trailer), trailer
