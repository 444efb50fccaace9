"""SGLang: the `sglang.srt.plugins` entry point that puts NodecommAllreduce in SGLang's custom
all-reduce slot.

SGLang's GroupCoordinator asks dispatch_custom_allreduce(group=, device=) in
sglang.srt.distributed.device_communicators.custom_all_reduce for the class to build (imported
inside its constructor), then builds it with (group=, device=). The plugin registers a REPLACE hook
for that function with SGLang's HookRegistry, which SGLang's load_plugins applies once every
plugin has registered: it also rewrites the copies other modules imported by name, and it warns
when another plugin replaces the same function (a plain setattr would lose to it silently). Only
with NODECOMM_CUSTOM_ALLREDUCE=1 (see docs/engine-guide.md).

SGLang's RMSNorm after a tensor-parallel all-reduce calls FlashInfer's fused
flashinfer_allreduce_residual_rmsnorm on CUDA (its custom all-reduce's fused_allreduce_rmsnorm on
ROCm only). The plugin wraps that function (an AROUND hook): where the group's slot holds nodecomm
and takes the size, nodecomm's all_reduce_rms_norm answers; every other call goes on to FlashInfer's.
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


FUSED_NORM = "sglang.srt.layers.flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm"


def allreduce_residual_rmsnorm(
    original, input_tensor: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
    max_token_num: int = 2048, use_oneshot: bool | None = None, trigger_completion_at_end: bool = False,
    fp32_acc: bool = True, use_attn_tp_group: bool = True,
):  # fmt: skip
    """flashinfer_allreduce_residual_rmsnorm's signature and answer, (norm_output, residual_output):
    nodecomm's where the group's slot takes the call, FlashInfer's (`original`) otherwise."""
    slot = _slot(use_attn_tp_group)
    fused = None if slot is None else slot.fused_allreduce_rmsnorm(input_tensor, residual, weight, eps)
    if fused is not None:
        return fused
    return original(
        input_tensor, residual, weight, eps, max_token_num, use_oneshot, trigger_completion_at_end, fp32_acc,
        use_attn_tp_group,
    )  # fmt: skip


def _slot(attention: bool) -> NodecommAllreduce | None:
    """The slot object of SGLang's attention (or MoE) tensor-parallel group, where it is nodecomm's."""
    from sglang.srt.distributed import parallel_state

    try:
        group = parallel_state.get_attn_tp_group() if attention else parallel_state.get_moe_tp_group()
    except (AssertionError, AttributeError):  # groups not formed: FlashInfer's function decides
        return None
    slot = getattr(group, "ca_comm", None)
    return slot if isinstance(slot, NodecommAllreduce) and not slot.disabled else None


def register() -> None:
    """SGLang's plugin loader calls this with no arguments, then applies the hooks registered."""
    if not requested():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SLOT, dispatch_custom_allreduce, HookType.REPLACE)
    HookRegistry.register(FUSED_NORM, allreduce_residual_rmsnorm, HookType.AROUND)
    log.info("nodecomm takes SGLang's custom all-reduce slot", extra={"switch": ENVIRONMENT_VARIABLE})
