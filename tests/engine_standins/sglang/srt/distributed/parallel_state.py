"""Stand-in for SGLang's GroupCoordinator: how it builds, uses and drops its custom all-reduce."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

# SGLang's ParallelContext holds the attention and MoE tensor-parallel groups; here the group last
# built is both.
_TP_GROUP = None


def get_attn_tp_group():
    return _TP_GROUP


def get_moe_tp_group():
    return _TP_GROUP


class GroupCoordinator:
    def __init__(self, cpu_group, device_group, device):
        global _TP_GROUP
        _TP_GROUP = self
        self.cpu_group, self.device_group, self.device = cpu_group, device_group, device
        from sglang.srt.distributed.device_communicators.custom_all_reduce import dispatch_custom_allreduce

        self.ca_comm = None
        try:
            ca_class = dispatch_custom_allreduce(group=self.cpu_group, device=self.device)
            self.ca_comm = ca_class(group=self.cpu_group, device=self.device)
        except Exception as error:  # SGLang logs and runs without one
            self.ca_error = error

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        ca_comm = self.ca_comm
        if ca_comm is not None and not ca_comm.disabled and ca_comm.should_custom_ar(input_):
            out = ca_comm.custom_all_reduce(input_)  # _all_reduce_out_place, method "ca"
            assert out is not None
            return out
        dist.all_reduce(input_, group=self.device_group)  # inplace_all_reduce
        return input_

    @contextlib.contextmanager
    def graph_capture(self, stream):
        capture = self.ca_comm.capture() if self.ca_comm is not None else contextlib.nullcontext()
        if stream is None:
            with capture:
                yield
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), capture:
            yield

    def destroy(self) -> None:
        # SGLang destroys its process groups before it drops the custom all-reduce.
        if self.device_group is not self.cpu_group:
            dist.destroy_process_group(self.device_group)
        dist.destroy_process_group(self.cpu_group)
        self.ca_comm = None
