"""The one switch both engines' plugins obey: installing nodecomm changes no engine until asked."""

from __future__ import annotations

import os

ENVIRONMENT_VARIABLE = "NODECOMM_CUSTOM_ALLREDUCE"


def requested() -> bool:
    """$NODECOMM_CUSTOM_ALLREDUCE is 1, true, yes or on (case-insensitive)."""
    return os.environ.get(ENVIRONMENT_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")
