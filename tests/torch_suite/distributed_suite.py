"""PyTorch's own distributed test suite (DistributedTest._DistTestBase, the one its
test_distributed_spawn.py runs for gloo and nccl), for the backend named in $BACKEND.

Run as `python -m pytest tests/torch_suite/distributed_suite.py` with BACKEND, WORLD_SIZE and
TEMP_DIR set (and NODECOMM_SOCKET for BACKEND=nodecomm); tests/test_torch_suite.py does so. The
rank processes are forked rather than spawned (ten times faster here); the parent holds no CUDA
context and no gRPC channel to inherit.
"""

import os

import torch
from torch.testing._internal.common_distributed import DistTestCases

if os.environ.get("BACKEND") == "nodecomm":
    import nodecomm.distributed  # noqa: F401 (registers the backend)

    # The suite's hook for an out-of-tree backend, and the features it has.
    for feature in ("plugin", "subgroup", "ddp"):
        DistTestCases.backend_feature[feature].add("nodecomm")
    if torch.cuda.is_available():
        for feature in ("gpu", "cuda"):
            DistTestCases.backend_feature[feature].add("nodecomm")

# Imported after the features are set: its decorators read them.
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


class TestDistributed(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)
