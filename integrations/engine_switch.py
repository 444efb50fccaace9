"""What both engines' plugins do: take the slot, and only when asked (installing nodecomm changes
no engine by itself)."""

from __future__ import annotations

import importlib
import logging
import os

log = logging.getLogger("nodecomm.integrations")

ENVIRONMENT_VARIABLE = "NODECOMM_CUSTOM_ALLREDUCE"  # the custom all-reduce slot, both engines
PLATFORM_VARIABLE = "NODECOMM_VLLM_PLATFORM"  # vLLM's platform, whose communicator asks nodecomm first


def requested(variable: str = ENVIRONMENT_VARIABLE) -> bool:
    """$`variable` is 1, true, yes or on (case-insensitive)."""
    return os.environ.get(variable, "").strip().lower() in ("1", "true", "yes", "on")


def take_slot(module_name: str, attribute: str, replacement: object, engine: str) -> None:
    """Set `module_name`.`attribute` to `replacement` when requested(); again is a no-op."""
    if not requested():
        return
    module = importlib.import_module(module_name)
    if getattr(module, attribute) is not replacement:
        setattr(module, attribute, replacement)
        log.info(f"nodecomm takes {engine}'s custom all-reduce slot", extra={"switch": ENVIRONMENT_VARIABLE})
