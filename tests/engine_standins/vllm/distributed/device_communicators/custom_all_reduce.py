"""Stand-in for vLLM's module of this path: only the name its CudaCommunicator imports."""


class CustomAllreduce:
    def __init__(self, *args, **kwargs):
        raise AssertionError("vLLM's own custom all-reduce was built: the nodecomm plugin did not take the slot")
