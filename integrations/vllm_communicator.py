"""NodecommCudaCommunicator: vLLM's CudaCommunicator with nodecomm ahead of every other all-reduce.

vLLM's CudaCommunicator.all_reduce tries NCCL symmetric memory, QuickReduce, FlashInfer, AITER,
its custom all-reduce, torch symmetric memory, then PyNccl. This subclass asks nodecomm first: a
size nodecomm's table gives one of its own paths runs there (NodecommAllreduce, as in the slot:
every size and never NCCL for a batch-invariant engine); every other size, and every other
collective, goes through the parent in its own order. It is a CudaCommunicator, so vLLM's
graph_capture() takes it as one. Imported by vLLM only, after vLLM is.

It also runs the all-reduce a tensor-parallel layer ends with fused with the residual add and
RMSNorm after it (all_reduce_rms_norm), and registers that as the torch op
torch.ops.nodecomm.all_reduce_rms_norm(x, residual, weight, eps, group_name), which a model (or a
compile pass) calls with vLLM's group name, as vLLM's own torch.ops.vllm.all_reduce is called:
nodecomm's fused kernels where the group's communicator is this one and takes the size, vLLM's
all-reduce and torch's add and RMSNorm otherwise.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

from .custom_all_reduce import NodecommAllreduce

log = logging.getLogger("nodecomm.integrations")

_FUSION_HINT = (
    "vLLM's fuse_allreduce_rms pass rewrites all-reduce + RMSNorm into FlashInfer's fused kernel, which "
    "nodecomm never sees: set compilation_config.pass_config.fuse_allreduce_rms=false "
    '(--compilation-config \'{"pass_config": {"fuse_allreduce_rms": false}}\') to hand those all-reduces to nodecomm'
)
_warned = False


class NodecommCudaCommunicator(CudaCommunicator):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.nodecomm: NodecommAllreduce | None = None
        if dist.get_world_size(self.cpu_group) > 1:
            # The slot may hold nodecomm already (NODECOMM_CUSTOM_ALLREDUCE too): one group, not two.
            ca_comm = getattr(self, "ca_comm", None)
            self.nodecomm = ca_comm if isinstance(ca_comm, NodecommAllreduce) else NodecommAllreduce(
                self.cpu_group, self.device
            )  # fmt: skip
        _warn_if_fused()

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        nodecomm = self.nodecomm
        out = None if nodecomm is None else nodecomm.custom_all_reduce(input_)  # None: declined
        return super().all_reduce(input_) if out is None else out

    def all_reduce_rms_norm(
        self, input_: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(all_reduce(input_) + residual) * weight, all_reduce(input_) + residual), new
        tensors: one nodecomm call where nodecomm takes the size (nodecomm.rms_norm's bits), else
        this communicator's all_reduce and torch's add and RMSNorm."""
        nodecomm = self.nodecomm
        fused = None if nodecomm is None or nodecomm.disabled else nodecomm.fused_allreduce_rmsnorm(
            input_, residual, weight, eps
        )  # fmt: skip
        if fused is not None:
            return fused
        return _add_rms_norm(self.all_reduce(input_), residual, weight, eps)

    def destroy(self) -> None:
        nodecomm, self.nodecomm = self.nodecomm, None
        if nodecomm is not None and nodecomm is not getattr(self, "ca_comm", None):
            nodecomm.close()
        super().destroy()


def _warn_if_fused() -> None:
    """One warning per process where vLLM's fusion pass would take the all-reduces anyway."""
    global _warned
    try:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        fused = bool(config is not None and config.compilation_config.pass_config.fuse_allreduce_rms)
    except (ImportError, AttributeError):
        return
    if fused and not _warned:
        _warned = True
        log.warning(_FUSION_HINT)


@torch.library.custom_op("nodecomm::all_reduce_rms_norm", mutates_args=())
def all_reduce_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, residual_out) of the vLLM group named `group_name` (GroupCoordinator.unique_name):
    its communicator's all_reduce_rms_norm where it is nodecomm's, else its all-reduce and torch's
    add and RMSNorm."""
    from vllm.distributed.parallel_state import _groups

    group = _groups[group_name]()
    communicator = getattr(group, "device_communicator", None)
    if isinstance(communicator, NodecommCudaCommunicator):
        return communicator.all_reduce_rms_norm(x, residual, weight, eps)
    return _add_rms_norm(group.all_reduce(x), residual, weight, eps)


def _add_rms_norm(
    summed: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """What nodecomm does not fuse: torch's add and RMSNorm after vLLM's all-reduce."""
    residual_out = summed + residual
    return torch.nn.functional.rms_norm(residual_out, (weight.numel(),), weight, eps), residual_out


@all_reduce_rms_norm.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_name: str):
    return torch.empty_like(x), torch.empty_like(x)
