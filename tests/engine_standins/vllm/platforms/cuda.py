"""Stand-in for vLLM's module of this path: the CUDA platform and the communicator it names."""


class CudaPlatform:
    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator"
