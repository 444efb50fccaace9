"""nodecomm in the engines' own slots: `NodecommAllreduce` is the class vLLM and SGLang call as
their custom all-reduce; nodecomm.integrations.vllm and .sglang put it there."""

from .custom_all_reduce import NodecommAllreduce

__all__ = ["NodecommAllreduce"]
