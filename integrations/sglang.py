"""SGLang: the `sglang.srt.plugins` entry point that puts NodecommAllreduce in SGLang's custom
all-reduce slot.

SGLang's GroupCoordinator asks dispatch_custom_allreduce(group=, device=) in
sglang.srt.distributed.device_communicators.custom_all_reduce for the class to build (imported
inside its constructor), then builds it with (group=, device=); replacing that function is the
patch point. Only with NODECOMM_CUSTOM_ALLREDUCE=1 (see docs/engine-guide.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .custom_all_reduce import NodecommAllreduce
from .engine_switch import take_slot

SLOT_MODULE = "sglang.srt.distributed.device_communicators.custom_all_reduce"


def dispatch_custom_allreduce(group: dist.ProcessGroup, device: int | str | torch.device) -> type[NodecommAllreduce]:
    """What SGLang's own function of this name answers: the class to build for (group, device)."""
    return NodecommAllreduce


def register() -> None:
    """SGLang's plugin loader calls this with no arguments."""
    take_slot(SLOT_MODULE, "dispatch_custom_allreduce", dispatch_custom_allreduce, "SGLang")
