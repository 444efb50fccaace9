"""Stand-in for vLLM's CudaCommunicator: how it builds, uses and drops its custom all-reduce."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class CudaCommunicator:
    def __init__(self, cpu_group, device, device_group):
        self.cpu_group, self.device, self.device_group = cpu_group, device, device_group
        # vLLM imports the class here, inside the constructor, on every construction.
        from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce

        self.ca_comm = CustomAllreduce(
            group=self.cpu_group, device=self.device, symm_mem_enabled=False, register_graph_buffers=True
        )

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        ca_comm = self.ca_comm
        if ca_comm is not None and not ca_comm.disabled and ca_comm.should_custom_ar(input_):
            out = ca_comm.custom_all_reduce(input_)
            assert out is not None
            return out
        out = input_.clone()  # PyNccl's out-of-place all-reduce
        dist.all_reduce(out, group=self.device_group)
        return out

    @contextlib.contextmanager
    def graph_capture(self, stream):
        """GroupCoordinator.graph_capture: the capture stream first, then ca_comm.capture()."""
        capture = self.ca_comm.capture() if self.ca_comm is not None else contextlib.nullcontext()
        if stream is None:
            with capture:
                yield
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), capture:
            yield

    def destroy(self) -> None:
        self.ca_comm = None  # vLLM never calls close(); the object's __del__ does
