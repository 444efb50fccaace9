"""The reliability suites' daemon fixture, the RPC fuzzers' world, and the line that sums up what the
fuzzers tried."""

from __future__ import annotations

import signal

import pytest

from .fuzz_world import world  # noqa: F401 (the RPC fuzzers' real groups, a fixture)
from .harness import FIGURES, Checked, start_fuzz_daemon


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory):
    """One daemon for the whole module, with short timeouts; killed afterwards."""
    daemon = start_fuzz_daemon(tmp_path_factory.mktemp("fuzzd"))
    try:
        yield daemon
    finally:
        daemon.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def checked(fuzz_daemon):
    caller = Checked(fuzz_daemon)
    try:
        yield caller
    finally:
        caller.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = FIGURES.lines()
    if lines:
        terminalreporter.write_sep("-", "reliability")
        for line in lines:
            terminalreporter.write_line(line)
        if config.option.verbose > 0:
            for line in FIGURES.outcome_lines():
                terminalreporter.write_line(line)
