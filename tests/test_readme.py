"""The README's examples, run as written with nothing deployed (no node daemon; this test's own
runtime and cache directories): the Quick start's job under torchrun and "Use it from a rank"'s
program, two ranks each. The install line is the one step left out (CI ran it on this clone)."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"


def _block(section: str, language: str) -> str:
    """The first `language` code block under the README's `section` heading."""
    text = README.read_text().split(f"\n## {section}\n", 1)[1]
    return re.search(rf"```{language}\n(.*?)```", text, re.S).group(1)


@pytest.fixture
def nothing_deployed(tmp_path: Path):
    """An environment where no node daemon answers: runtime and cache directories of the test's own
    (the runtime one short: a job's socket path under it must fit a Unix socket's 108 bytes)."""
    runtime = tempfile.mkdtemp(prefix="nc-readme-")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NODECOMM_")}
    bin_directory = str(Path(sys.executable).parent)
    yield environment | {
        # No node daemon's socket or stored calibration either (a machine that runs one: root's paths).
        "XDG_RUNTIME_DIR": runtime, "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "NODECOMM_SOCKET": os.path.join(runtime, "no-node-daemon.sock"), "NODECOMM_STATE_DIR": str(tmp_path / "state"),
        "PATH": f"{bin_directory}:{environment['PATH']}",
    }  # fmt: skip
    shutil.rmtree(runtime, ignore_errors=True)


def test_the_quick_start_job_runs_as_written(tmp_path, nothing_deployed):
    """Both ranks print the sum and the one private daemon; what they print may interleave (torchrun
    gives both one stdout), so the test counts rather than parses lines."""
    script = "\n".join(line for line in _block("Quick start", "bash").splitlines() if "pip install" not in line)
    result = subprocess.run(
        ["bash", "-euc", script], cwd=tmp_path, env=nothing_deployed, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout + result.stderr
    runtime = nothing_deployed["XDG_RUNTIME_DIR"]
    assert result.stdout.count("3.0") == 2 and result.stdout.count(f"a private daemon at {runtime}") == 2, result.stdout
    assert result.stdout.count("(started by this process)") == 1, result.stdout


def test_use_it_from_a_rank_runs_as_written(tmp_path, nothing_deployed):
    (tmp_path / "rank.py").write_text(_block("Use it from a rank", "python"))
    environment = nothing_deployed
    ranks = [
        subprocess.Popen(
            [sys.executable, "rank.py", str(rank)],
            cwd=tmp_path,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    try:
        outputs = [process.communicate(timeout=240) for process in ranks]
    finally:
        for process in ranks:
            process.kill()  # a rank that hung: not left behind
    for process, (stdout, stderr) in zip(ranks, outputs, strict=True):
        assert process.returncode == 0, stdout + stderr
    for rank, (stdout, _) in enumerate(outputs):
        assert stdout.startswith(f"{rank} 3.0 True [0, 1] a private daemon at {environment['XDG_RUNTIME_DIR']}"), stdout
        assert "(0, 32768, <Path.ONESHOT: 'oneshot'>)" in stdout, stdout
