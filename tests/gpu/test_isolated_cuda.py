"""The CUDA paths as the shipped manifests run them (deploy/kubernetes: hostIPC false, and every
pod its own /dev/shm): the daemon and two rank processes each in mount and IPC namespaces of
their own (unshare), each with a private /dev/shm. What they share is the socket directory, the
device nodes and, here, the rest of the filesystem (where the code lives). Every kernel path and
the service path, bit for bit; with the service path ordered by IPC events, which need a shared
/dev/shm, it must fail with an error, never give wrong bits."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nodecomm.client.daemon_process import answers, daemon_command
from waiting import wait_until

pytestmark = pytest.mark.gpu

TESTS = Path(__file__).resolve().parent
RANK = "import json, sys; import cuda_ranks; print(json.dumps(cuda_ranks.isolated_rank(*map(int, sys.argv[1:3]), sys.argv[3])))"


def isolated(command: list[str]) -> list[str]:
    """`command` in new mount and IPC namespaces, with a /dev/shm of its own."""
    private_shm = 'mount -t tmpfs -o size=1g tmpfs /dev/shm && exec "$@"'
    return [
        "unshare",
        "--mount",
        "--ipc",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        private_shm,
        "isolated",
        *command,
    ]


@pytest.fixture
def namespaces():
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root (mount and IPC namespaces)")
    tried = subprocess.run(isolated(["true"]), capture_output=True, text=True, timeout=30)
    if tried.returncode != 0:
        pytest.skip(f"unshare failed here: {tried.stderr.strip()}")


@pytest.mark.parametrize("ordering", ["auto", "ipc-events"])
def test_every_cuda_path_in_namespaces_of_their_own(namespaces, tmp_path, ordering):
    run = tmp_path / "run"  # the socket directory: the one thing the manifests share
    run.mkdir()
    socket = str(run / "nodecomm.sock")
    flags = ["--allow-shared-devices", "true", "--state-dir", str(tmp_path / "state"), "--metrics-address", "off"]
    flags += ["--cuda-service-ordering", ordering, "--operation-timeout-seconds", "20"]
    log = open(tmp_path / "daemon.log", "wb")
    daemon = subprocess.Popen(isolated(daemon_command(socket, *flags)), stdout=log, stderr=subprocess.STDOUT)

    def serving() -> bool:
        assert daemon.poll() is None, (tmp_path / "daemon.log").read_text()
        return answers(socket, timeout=0.5)

    try:
        wait_until(serving, 60, lambda: f"the isolated daemon answering:\n{(tmp_path / 'daemon.log').read_text()}")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
        }
        ranks = [
            subprocess.Popen(isolated([sys.executable, "-c", RANK, str(rank), "2", socket]), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(2)
        ]  # fmt: skip
        outputs = [rank.communicate(timeout=240) for rank in ranks]
    finally:
        daemon.kill()
        daemon.wait()
        log.close()
    results = []
    for rank, (out, err) in enumerate(outputs):
        assert out.strip(), f"rank {rank} printed nothing: {err[-3000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    print(f"\n{ordering}: {results}")
    for found in results:
        assert found["problems"] == [], found
        assert not found["service"].startswith("wrong"), found
    if ordering == "auto":
        assert results[0]["ordering"] == "stream-words", results
        assert [found["service"] for found in results] == ["exact", "exact"], results
    else:
        assert results[0]["ordering"] == "ipc-events", results
