"""The hot path on CUDA, ranks sharing the GPU under MPS (NC_MPS=1 in .ci/device-run.sh; without
it each barrier costs a time slice and 150,000 calls take minutes): no call of any API
synchronises with the GPU, table switch points included (every 16th call here), and 100,000
asynchronous all-reduces leave neither GPU memory nor outstanding Works behind."""

import pytest

import hot_path_ranks
from conftest import free_port

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(560)
def test_no_call_synchronises_and_async_works_leave_nothing_behind(make_daemon, spawn_ranks):
    daemon = make_daemon("--allow-shared-devices", "true", "--table-switch-period", "16")
    results = spawn_ranks(
        hot_path_ranks.no_sync_no_growth, 2, 2, daemon.socket, free_port(), 10_000, 100_000, timeout=540
    ).values()
    for outcome in results.values():
        print(outcome)
        assert outcome["synchronised"] == {} and outcome["waited"] == [], outcome
        assert outcome["after"] == outcome["before"], outcome
