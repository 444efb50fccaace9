"""The daemon's /metrics against the real Prometheus tools: promtool lints the exposition of a
daemon that serves an active CPU group, and a Prometheus server scrapes that daemon and answers
PromQL over its series. A missing prometheus/promtool (Debian package `prometheus`) fails under CI
(CI set) and skips elsewhere."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import queue
import shutil
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

import ranks
from conftest import free_port
from waiting import wait_until

WORLD_SIZE = 2
WAIT_SECONDS = 60.0  # every wait below is bounded by this
INSTALL = "apt-get install --no-install-recommends prometheus (.ci/run does)"


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path:
        return path
    if os.environ.get("CI"):
        pytest.fail(f"{name} not found: {INSTALL}")
    pytest.skip(f"{name} not found ({INSTALL})")


@pytest.fixture
def promtool() -> str:
    return require_tool("promtool")


@pytest.fixture
def prometheus() -> str:
    return require_tool("prometheus")


@pytest.fixture
def active_group(daemon, spawn_ranks):
    """The daemon with group "prom" formed and held by WORLD_SIZE ranks that have all-reduced
    through oneshot, twoshot and the service path; the ranks leave when the test is done."""
    context = mp.get_context("spawn")
    report, commands = context.Queue(), context.Queue()
    group = spawn_ranks(
        ranks.hold_group_for_metrics, WORLD_SIZE, WORLD_SIZE, daemon.socket, report, commands, timeout=240
    )
    running: set[int] = set()

    def every_rank_running() -> bool:
        try:
            running.add(report.get(timeout=0.5)[1])
        except queue.Empty:
            if any(p.exitcode is not None for p in group.processes.values()):
                for _ in range(WORLD_SIZE):
                    commands.put("stop")  # let ranks that did report leave at once
                group.values()  # fails the test with the rank's traceback
        return len(running) == WORLD_SIZE

    wait_until(every_rank_running, WAIT_SECONDS, lambda: f"ranks {sorted(set(range(WORLD_SIZE)) - running)} running")
    yield daemon
    for _ in range(WORLD_SIZE):
        commands.put("stop")
    expected = float(sum(range(1, WORLD_SIZE + 1)))
    for rank, seen in group.values().items():
        assert seen == {"oneshot": [expected], "twoshot": [expected], "service": [expected]}, (rank, seen)


def lint(promtool: str, text: str) -> tuple[int, str]:
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=WAIT_SECONDS
    )
    return result.returncode, (result.stdout + result.stderr).strip()


def test_promtool_accepts_the_metrics_of_a_daemon_with_an_active_group(promtool, active_group):
    text = active_group.metrics_text()
    assert 'nodecomm_groups{state="active"} 1.0' in text, text
    assert 'nodecomm_service_collectives_total{op="all_reduce",result="ok"}' in text, text
    assert 'nodecomm_rpc_seconds_bucket{le="+Inf",method="Join"}' in text, text
    rc, output = lint(promtool, text)
    assert (rc, output) == (0, ""), f"promtool check metrics (rc {rc}):\n{output}"


def test_promtool_lint_catches_problems(promtool):
    """The check above can fail: promtool flags a counter without _total and a non-base unit."""
    bad = "# HELP bad_count A count.\n# TYPE bad_count counter\nbad_count 1\n# TYPE bad_milliseconds gauge\nbad_milliseconds 2\n"
    rc, output = lint(promtool, bad)
    assert rc != 0 and '"_total" suffix' in output and "base unit" in output and "no help text" in output, output


class Prometheus:
    """A Prometheus server on a free loopback port, scraping `target` every second."""

    def __init__(self, binary: str, directory: Path, target: str) -> None:
        self.port = free_port()
        self.directory = directory
        directory.mkdir()
        config = directory / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            f'scrape_configs:\n  - job_name: nodecomm\n    static_configs:\n      - targets: ["{target}"]\n'
        )
        self.log_path = directory / "prometheus.log"
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=directory,
        )

    def get(self, path: str) -> bytes:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5).read()

    def query(self, expr: str) -> list[dict]:
        reply = json.loads(self.get("/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        assert reply["status"] == "success", reply
        return reply["data"]["result"]

    def alive(self) -> None:
        if self.process.poll() is not None:
            pytest.fail(f"prometheus exited with {self.process.returncode}:\n{self.log()}")

    def wait_ready(self) -> None:
        def ready() -> bool:
            self.alive()
            try:
                return bool(self.get("/-/ready").strip())
            except (urllib.error.URLError, ConnectionError):
                return False

        wait_until(ready, WAIT_SECONDS, lambda: f"prometheus ready:\n{self.log()}")

    def wait_for(self, expr: str, check) -> float:
        """Poll the instant query `expr` until it returns one sample whose value passes `check`;
        returns that value, or fails the test with the last answer and the scrape's state."""
        last: list[object] = ["no answer"]

        def passed() -> tuple[float] | None:  # a tuple, so that a passing 0.0 ends the wait too
            self.alive()
            last[0] = result = self.query(expr)
            if len(result) == 1 and check(value := float(result[0]["value"][1])):
                return (value,)
            return None

        def state() -> str:
            targets = json.loads(self.get("/api/v1/targets"))["data"]["activeTargets"]
            scrape = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in targets]
            return f"{expr!r} passing its check (last answer {last[0]}; targets {scrape})\n{self.log()}"

        (value,) = wait_until(passed, WAIT_SECONDS, state)
        return value

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def test_prometheus_scrapes_the_daemon_and_answers_queries(prometheus, active_group, tmp_path):
    server = Prometheus(prometheus, tmp_path / "prometheus", f"127.0.0.1:{active_group.metrics_port}")
    try:
        server.wait_ready()
        server.wait_for('up{job="nodecomm"}', lambda v: v == 1)
        server.wait_for('nodecomm_groups{state="active"}', lambda v: v == 1)
        server.wait_for('nodecomm_groups{state="aborted"}', lambda v: v == 0)
        server.wait_for("nodecomm_ranks", lambda v: v == WORLD_SIZE)
        server.wait_for('nodecomm_reserved_bytes{kind="host"}', lambda v: v > 0)
        server.wait_for('sum(nodecomm_service_collectives_total{op="all_reduce", result="ok"})', lambda v: v > 0)
        server.wait_for('nodecomm_rpc_seconds_count{method="Join"}', lambda v: v >= WORLD_SIZE)
        # Join waits for the peers, so its median lies between the first bucket and the last finite one.
        median = server.wait_for(
            'histogram_quantile(0.5, sum by (le) (nodecomm_rpc_seconds_bucket{method="Join"}))',
            lambda v: math.isfinite(v),
        )
        assert 0 < median <= 10, median
        # The daemon's types reach Prometheus' metadata.
        metadata = json.loads(server.get("/api/v1/metadata?metric=nodecomm_rpc_seconds"))["data"]
        assert [m["type"] for m in metadata.get("nodecomm_rpc_seconds", [])] == ["histogram"], metadata
    finally:
        server.stop()
