"""NodecommCudaPlatform: vLLM's CUDA platform, whose communicator puts nodecomm first.

vLLM asks its `vllm.platform_plugins` entry points for a platform's qualified name and prefers an
out-of-tree one (nodecomm.integrations.vllm:platform, which answers only when asked); every
GroupCoordinator then builds the communicator the platform names. Everything else is vLLM's CUDA
platform, so vLLM still treats the machine as CUDA. Imported by vLLM only, after vLLM is.
"""

from __future__ import annotations

from vllm.platforms.cuda import CudaPlatform


class NodecommCudaPlatform(CudaPlatform):
    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "nodecomm.integrations.vllm_communicator.NodecommCudaCommunicator"
