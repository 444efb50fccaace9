"""What both engines' plugins ask first: whether they are asked to act (installing nodecomm changes
no engine by itself)."""

from __future__ import annotations

import os

ENVIRONMENT_VARIABLE = "NODECOMM_CUSTOM_ALLREDUCE"  # the custom all-reduce slot, both engines
PLATFORM_VARIABLE = "NODECOMM_VLLM_PLATFORM"  # vLLM's platform, whose communicator asks nodecomm first
DCP_TOPK_VARIABLE = "NODECOMM_DCP_TOPK"  # vLLM's DCP top-k merge on nodecomm's owner exchange


def requested(variable: str = ENVIRONMENT_VARIABLE) -> bool:
    """$`variable` is 1, true, yes or on (case-insensitive)."""
    return os.environ.get(variable, "").strip().lower() in ("1", "true", "yes", "on")
