"""SGLang: the `sglang.srt.plugins` entry point that puts NodecommAllreduce in SGLang's custom
all-reduce slot.

SGLang's GroupCoordinator asks dispatch_custom_allreduce(group=, device=) in
sglang.srt.distributed.device_communicators.custom_all_reduce for the class to build (imported
inside its constructor), then builds it with (group=, device=). The plugin registers a REPLACE hook
for that function with SGLang's HookRegistry, which SGLang's load_plugins applies once every
plugin has registered: it also rewrites the copies other modules imported by name, and it warns
when another plugin replaces the same function (a plain setattr would lose to it silently). Only
with NODECOMM_CUSTOM_ALLREDUCE=1 (see docs/engine-guide.md).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .custom_all_reduce import NodecommAllreduce
from .engine_switch import ENVIRONMENT_VARIABLE, requested

log = logging.getLogger("nodecomm.integrations")

SLOT = "sglang.srt.distributed.device_communicators.custom_all_reduce.dispatch_custom_allreduce"


def dispatch_custom_allreduce(group: dist.ProcessGroup, device: int | str | torch.device) -> type[NodecommAllreduce]:
    """What SGLang's own function of this name answers: the class to build for (group, device)."""
    return NodecommAllreduce


def register() -> None:
    """SGLang's plugin loader calls this with no arguments, then applies the hooks registered."""
    if not requested():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SLOT, dispatch_custom_allreduce, HookType.REPLACE)
    log.info("nodecomm takes SGLang's custom all-reduce slot", extra={"switch": ENVIRONMENT_VARIABLE})
