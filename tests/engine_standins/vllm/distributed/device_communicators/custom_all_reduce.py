"""Stand-in for vLLM's module of this path: only the name its CudaCommunicator imports. vLLM's
own class is not here: built, it declines every size and says it was built, so that a test of the
slot sees that the plugin did not take it (the class name is not NodecommAllreduce)."""

import contextlib


class CustomAllreduce:
    disabled = True

    def __init__(self, *args, **kwargs):
        pass

    def should_custom_ar(self, inp) -> bool:
        return False

    @contextlib.contextmanager
    def capture(self):
        yield

    @staticmethod
    def create_shared_buffer(size_in_bytes, group=None, uncached=False):
        """vLLM's static helper (IPC buffers of the caller's own), here naming what it was asked."""
        return ["vLLM's own", size_in_bytes]

    @staticmethod
    def free_shared_buffer(pointers, group=None, rank=None):
        return None
