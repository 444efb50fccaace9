"""The "nodecomm" backend on CUDA tensors under torchrun: every collective exact on default and
sub-groups, async work ordered by streams, dist.all_reduce captured in a CUDA graph, device_id=
and mixed backend strings. Ranks share
the GPU where there is one."""

import pytest

from test_distributed import reports, torchrun

pytestmark = pytest.mark.gpu


def test_every_collective_on_cuda_tensors(make_daemon):
    daemon = make_daemon("--allow-shared-devices", "true", "--operation-timeout-seconds", "60")
    found = reports(torchrun(2, daemon.socket, "cuda"))
    assert found == {0: [], 1: []}


def test_a_group_bound_to_its_gpu_and_a_mixed_backend_string(make_daemon):
    daemon = make_daemon("--allow-shared-devices", "true", "--operation-timeout-seconds", "60")
    assert reports(torchrun(2, daemon.socket, "device_id")) == {0: [], 1: []}


def test_ddp_with_its_comm_hooks_and_dtensor_give_gloos_bits_on_cuda(make_daemon):
    """DDP's buckets are asynchronous CUDA all-reduces (the C++ backend's native Work), 20 steps
    with the default reduction, allreduce_hook and fp16_compress_hook; DTensor tensor parallelism:
    the same bits as a gloo group of the same ranks, reducing the same CUDA tensors."""
    daemon = make_daemon("--allow-shared-devices", "true", "--operation-timeout-seconds", "60")
    assert reports(torchrun(2, daemon.socket, "workloads-cuda")) == {0: [], 1: []}
