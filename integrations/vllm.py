"""vLLM: the `vllm.general_plugins` entry point that puts NodecommAllreduce in vLLM's custom
all-reduce slot.

vLLM loads general plugins in every process before its workers build their communicators, and
its CudaCommunicator imports `CustomAllreduce` from
vllm.distributed.device_communicators.custom_all_reduce inside its constructor, so replacing that
module attribute is enough. Only with NODECOMM_CUSTOM_ALLREDUCE=1 (see docs/engine-guide.md).
"""

from __future__ import annotations

import importlib
import logging

from .custom_all_reduce import NodecommAllreduce
from .engine_switch import ENVIRONMENT_VARIABLE, requested

log = logging.getLogger("nodecomm.integrations")

SLOT_MODULE = "vllm.distributed.device_communicators.custom_all_reduce"


def register() -> None:
    """vLLM calls this with no arguments, possibly several times per process."""
    if not requested():
        return
    module = importlib.import_module(SLOT_MODULE)
    if module.CustomAllreduce is not NodecommAllreduce:
        module.CustomAllreduce = NodecommAllreduce
        log.info("nodecomm takes vLLM's custom all-reduce slot", extra={"switch": ENVIRONMENT_VARIABLE})
