"""Stand-in for vLLM's package of this path: the built-in CUDA platform plugin's answer (vLLM
0.34.0 vllm/platforms/__init__.py: the CUDA platform's qualified name where CUDA is there)."""


def cuda_platform_plugin() -> str | None:
    return "vllm.platforms.cuda.CudaPlatform"
