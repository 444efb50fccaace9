"""The daemon's own accounting, read from /metrics while a group works and after it is gone:
operation counts by group/op/path, buffer bytes by device and use, errors by kind."""

import multiprocessing as mp
import re

import grpc
import pytest

import ranks
from conftest import join_request, stub_for
from nodecomm.client.service_client import STAGING_MIN_BYTES
from waiting import wait_until


def sample(text: str, name: str, **labels) -> float | None:
    """The value of the series `name{labels}` in a /metrics text (labels in any order)."""
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match and dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))) == labels:
            return float(match.group(2))
    return None


def test_operation_counts_buffers_and_errors(daemon, spawn_ranks):
    context = mp.get_context("spawn")
    report, commands = context.Queue(), context.Queue()
    group = spawn_ranks(ranks.hold_group_for_metrics, 2, 2, daemon.socket, report, commands, timeout=120)
    assert {report.get(timeout=60)[1] for _ in range(2)} == {0, 1}
    expected = {"oneshot": 3 * 2, "twoshot": 3 * 2, "service": 3 * 2}  # 3 calls on each of 2 ranks

    def seen() -> dict[str, float]:
        text = daemon.metrics_text()
        return {p: sample(text, "nodecomm_operations_total", group="prom", op="all_reduce", path=p) for p in expected}

    # The ranks report their counts about once a second.
    wait_until(lambda: seen() == expected, 15, lambda: f"every call counted: {expected} (now {seen()})")
    text = daemon.metrics_text()
    assert sample(text, "nodecomm_operation_bytes_total", group="prom", op="all_reduce", path="service") == 6 * 16384
    reserved = sample(text, "nodecomm_reserved_bytes", kind="host")
    collectives = sample(text, "nodecomm_buffer_bytes", device="host", use="collectives")
    staging = sample(text, "nodecomm_buffer_bytes", device="host", use="service")  # the service path's copies
    # Each rank's 16 KiB copies fit in one staging buffer of the smallest size.
    assert collectives > 0 and staging == 2 * STAGING_MIN_BYTES and reserved == collectives + staging

    # A Join the daemon refuses (connect() would refuse it before dialling: nodecomm.join_rules).
    channel, stub = stub_for(daemon)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Join(join_request(group="bad name!", world_size=1), timeout=10)
    channel.close()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sample(daemon.metrics_text(), "nodecomm_errors_total", kind="InvalidArgumentError") == 1.0

    for _ in range(2):
        commands.put("stop")
    group.values()
    wait_until(
        lambda: sample(daemon.metrics_text(), "nodecomm_buffer_bytes", device="host", use="collectives") == 0.0,
        10,
        "the group's buffers no longer accounted after it left",
    )
    text = daemon.metrics_text()
    assert 'group="prom"' not in text  # its series went with it
