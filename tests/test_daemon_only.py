"""A daemon-only install: `pip install nodecomm` into an environment without torch builds and runs
the daemon (no nodecomm._c10d), and that daemon serves a CPU group to ranks that have torch.
What needs torch says so: the client's import, and a calibration the daemon would probe for."""

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import ranks
from conftest import Daemon
from nodecomm.client.daemon_process import answers
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def daemon_env(tmp_path_factory) -> Path:
    """A virtual environment holding nodecomm and its daemon's dependencies, and no torch."""
    where = tmp_path_factory.mktemp("daemon-only")
    env = where / "env"
    venv.EnvBuilder(with_pip=True).create(env)
    # A build folder of its own: the tree's build/ holds a CMake cache made with torch at hand.
    install = [
        str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
        "-C", f"build-dir={where / 'build'}", str(ROOT),
    ]  # fmt: skip
    built = subprocess.run(
        install, env={**os.environ, "NODECOMM_CPU_ONLY": "1"}, capture_output=True, text=True, timeout=1200
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return env


def isolated() -> dict[str, str]:
    """This environment less what would point another interpreter at this one's packages."""
    return {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}


def run_in(env: Path, code: str) -> subprocess.CompletedProcess:
    """`code` by env's interpreter, away from the source tree (whose nodecomm/ holds no native module)."""
    python = str(env / "bin" / "python")
    return subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, cwd=env, env=isolated())


def test_the_daemon_installs_without_torch_and_says_what_needs_it(daemon_env):
    assert "No module named 'torch'" in run_in(daemon_env, "import torch").stderr
    assert run_in(daemon_env, "import nodecomm._native, nodecomm.service.daemon").returncode == 0
    missing = run_in(daemon_env, "import nodecomm._c10d").stderr
    assert "No module named 'nodecomm._c10d'" in missing, missing
    client = run_in(daemon_env, "import nodecomm; nodecomm.connect").stderr
    assert "nodecomm's client needs torch: torch is not installed in this environment" in client, client
    assert "pip install torch (on a machine without a GPU" in client, client
    assert "pip install --force-reinstall --no-deps --no-cache-dir ." in client, client


def test_a_daemon_without_torch_serves_a_cpu_group_to_ranks_with_torch(daemon_env, tmp_path, spawn_ranks):
    served = Daemon(tmp_path)
    flags = ["--metrics-address", "off", "--state-dir", str(tmp_path / "state"), "--cache-dir", str(tmp_path / "c")]
    # Its own nodecommd: the environment's interpreter, none of this one's packages.
    command = [str(daemon_env / "bin" / "nodecommd"), "--socket", served.socket, *flags]
    with open(served.log_path, "ab") as log:
        served.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=isolated())
    try:
        wait_until(
            lambda: answers(served.socket) or served.process.poll() is not None,
            60,
            lambda: f"the daemon-only nodecommd serving: {served.log()[-2000:]}",
        )
        assert served.process.poll() is None, served.log()[-3000:]
        cases = [("float32", 1000), ("bfloat16", 4099), ("float16", 300_000)]
        results = spawn_ranks(ranks.all_reduce_cases, 2, 2, served.socket, cases, timeout=300).values()
        assert results == {0: [], 1: []}, results
        # Calibrating needs the bench's rank processes, which need torch: refused, saying so.
        calibrate = subprocess.run(
            [sys.executable, "-c", "import sys; from nodecomm.tools.cli import main; sys.exit(main())",
             "--socket", served.socket, "calibrate", "--device", "cpu"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert calibrate.returncode != 0, calibrate.stdout
        assert "which need torch, and this daemon's environment has none" in calibrate.stderr, calibrate.stderr
        assert "the container image's with-torch target" in calibrate.stderr, calibrate.stderr
    finally:
        served.stop()
