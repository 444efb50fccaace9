"""vLLM: the `vllm.general_plugins` entry point that puts NodecommAllreduce in vLLM's custom
all-reduce slot.

vLLM loads general plugins in every process before its workers build their communicators, and
its CudaCommunicator imports `CustomAllreduce` from
vllm.distributed.device_communicators.custom_all_reduce inside its constructor, so replacing that
module attribute is enough. Only with NODECOMM_CUSTOM_ALLREDUCE=1 (see docs/engine-guide.md).
"""

from __future__ import annotations

from .custom_all_reduce import NodecommAllreduce
from .engine_switch import take_slot

SLOT_MODULE = "vllm.distributed.device_communicators.custom_all_reduce"


def register() -> None:
    """vLLM calls this with no arguments, possibly several times per process."""
    take_slot(SLOT_MODULE, "CustomAllreduce", NodecommAllreduce, "vLLM")
