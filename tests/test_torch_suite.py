"""PyTorch's own distributed suite against the "nodecomm" backend and against gloo, side by side,
at world size 2 on the CPU: every test gloo passes must pass on nodecomm too, unless the suite
itself runs it only for backends named otherwise, or it is listed below with the reason."""

import collections
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

SUITE = Path(__file__).parent / "torch_suite" / "distributed_suite.py"

# Tests the suite runs for nodecomm that nodecomm does not pass, and why.
NOT_PASSING = {
    # torch's ProcessGroup names a C++ backend of BackendType::CUSTOM "custom" (getBackendName);
    # the suite compares DDP's logged name with dist.get_backend(), which says "nodecomm".
    "test_ddp_logging_data_cpu": "DDP logs an out-of-tree C++ backend's name as 'custom'",
}


def run_suite(backend: str, directory: Path, socket: str) -> dict[str, tuple[str, str]]:
    """{test name: (passed | failed | skipped, skip reason)} for one backend."""
    report = directory / f"{backend}.xml"
    env = {**os.environ, "BACKEND": backend, "WORLD_SIZE": "2", "NODECOMM_SOCKET": socket}
    env.pop("PYTEST_ADDOPTS", None)
    command = [sys.executable, "-m", "pytest", str(SUITE), "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    completed = subprocess.run(command, env=env, cwd=directory, capture_output=True, text=True, timeout=1200)
    if not report.exists():
        pytest.fail(f"the {backend} suite produced no report:\n{completed.stdout[-4000:]}\n{completed.stderr[-4000:]}")
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None:
            outcomes[case.get("name")] = ("skipped", skipped.get("message") or "")
        elif case.find("failure") is not None or case.find("error") is not None:
            outcomes[case.get("name")] = ("failed", "")
        else:
            outcomes[case.get("name")] = ("passed", "")
    return outcomes


def restricted_to_other_backends(reason: str) -> bool:
    """The suite skips a test for every backend but those it names (gloo, nccl, mpi, ucc)."""
    return "gloo" in reason.lower()


@pytest.mark.timeout(1800)
def test_pytorch_distributed_suite_passes_what_gloo_passes(daemon, tmp_path):
    gloo = run_suite("gloo", tmp_path, daemon.socket)
    nodecomm = run_suite("nodecomm", tmp_path, daemon.socket)
    counts = {
        name: collections.Counter(o for o, _ in outcomes.values())
        for name, outcomes in (("gloo", gloo), ("nodecomm", nodecomm))
    }
    print("\nPyTorch distributed suite, world size 2, CPU (passed / failed / skipped):")
    for name, count in counts.items():
        print(f"  {name:9} {count['passed']:4} {count['failed']:4} {count['skipped']:4}")

    assert set(gloo) == set(nodecomm) and len(gloo) > 250, "both runs must collect the same suite"
    assert counts["gloo"]["failed"] == 0, [t for t, (o, _) in gloo.items() if o == "failed"]
    unexplained = {
        test: nodecomm[test]
        for test, (outcome, _) in gloo.items()
        if outcome == "passed"
        and nodecomm[test][0] != "passed"
        and test not in NOT_PASSING
        and not (nodecomm[test][0] == "skipped" and restricted_to_other_backends(nodecomm[test][1]))
    }
    assert not unexplained, unexplained
    failed = {test for test, (outcome, _) in nodecomm.items() if outcome == "failed"} - set(NOT_PASSING)
    assert not failed, failed
    assert counts["nodecomm"]["passed"] >= 60
