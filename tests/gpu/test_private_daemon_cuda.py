"""A job's own daemon on a GPU machine: torchrun ranks with no node daemon start one that sees
every GPU, and every collective on CUDA tensors is exact through it."""

import os

import pytest

from test_distributed import reports, torchrun
from test_private_daemon import no_node_daemon, runtime_directory, wait_gone  # noqa: F401

pytestmark = pytest.mark.gpu


def test_collectives_on_cuda_through_a_private_daemon(no_node_daemon):  # noqa: F811
    environment = {**no_node_daemon, "NODECOMM_ALLOW_SHARED_DEVICES": "true", "CUDA_VISIBLE_DEVICES": "0"}
    daemons: dict[int, str] = {}
    found = reports(torchrun(2, no_node_daemon["NODECOMM_SOCKET"], "cuda", environment), daemons=daemons)
    assert found == {0: [], 1: []}
    kind, socket = daemons[0].split(" ", 1)
    assert kind == "private" and set(daemons.values()) == {daemons[0]}
    wait_gone(socket, 10)
    assert not os.path.exists(socket)
