"""SegmentMapping: one segment of a group's memory as mapped in this process."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SegmentMapping:
    address: int
    size_bytes: int
    legacy: bool = False  # a cudaIpcMemHandle import (closed, not unmapped)
    device: int | None = None  # where a legacy import was opened (it is closed there)
