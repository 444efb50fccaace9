"""vLLM: two entry points. `vllm.platform_plugins` (platform(), with NODECOMM_VLLM_PLATFORM=1)
makes vLLM's platform NodecommCudaPlatform, whose communicator asks nodecomm before any other
all-reduce (vllm_communicator.py); `vllm.general_plugins` (register(), with
NODECOMM_CUSTOM_ALLREDUCE=1), the lighter option, puts NodecommAllreduce in vLLM's custom
all-reduce slot, which vLLM tries after FlashInfer, QuickReduce and symmetric memory.

vLLM loads general plugins in every process before its workers build their communicators, and
its CudaCommunicator imports `CustomAllreduce` from
vllm.distributed.device_communicators.custom_all_reduce inside its constructor, so replacing that
module attribute is enough. Only with NODECOMM_CUSTOM_ALLREDUCE=1 (see docs/engine-guide.md).
The same general plugin, with NODECOMM_DCP_TOPK=1, puts vLLM's DCP top-k merge on nodecomm's
owner exchange (vllm_dcp_topk.py).
"""

from __future__ import annotations

import importlib
import logging

from . import vllm_dcp_topk
from .custom_all_reduce import NodecommAllreduce
from .engine_switch import ENVIRONMENT_VARIABLE, PLATFORM_VARIABLE, requested

log = logging.getLogger("nodecomm.integrations")

SLOT_MODULE = "vllm.distributed.device_communicators.custom_all_reduce"
# Static helpers of vLLM's class that code outside the communicator calls on whatever class holds
# the slot (vLLM 0.34.0: models/minimax_m3/amd/indexer_cp.py:40, ops/index_cp/host.py:44), for
# buffers of its own: the slot's class keeps vLLM's.
BUFFER_HELPERS = ("create_shared_buffer", "free_shared_buffer")


def register() -> None:
    """vLLM calls this with no arguments, possibly several times per process."""
    vllm_dcp_topk.install()  # with NODECOMM_DCP_TOPK=1
    if not requested():
        return
    module = importlib.import_module(SLOT_MODULE)
    original = module.CustomAllreduce
    if isinstance(original, type) and issubclass(original, NodecommAllreduce):  # again: a no-op
        return
    module.CustomAllreduce = slot_class(original)
    log.info("nodecomm takes vLLM's custom all-reduce slot", extra={"switch": ENVIRONMENT_VARIABLE})


def slot_class(original: type) -> type[NodecommAllreduce]:
    """NodecommAllreduce, with `original`'s static buffer helpers."""
    helpers = {name: staticmethod(getattr(original, name)) for name in BUFFER_HELPERS if hasattr(original, name)}
    return type(NodecommAllreduce.__name__, (NodecommAllreduce,), {**helpers, "__module__": __name__})


def platform() -> str | None:
    """vLLM asks every platform plugin for a platform's qualified name, None where it does not
    apply: nodecomm's CUDA platform where NODECOMM_VLLM_PLATFORM asks for it and vLLM finds CUDA."""
    if not requested(PLATFORM_VARIABLE):
        return None
    from vllm.platforms import cuda_platform_plugin

    if cuda_platform_plugin() is None:
        return None
    return "nodecomm.integrations.vllm_platform.NodecommCudaPlatform"
