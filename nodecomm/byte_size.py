"""Byte sizes as operators write them: "24MB", "512 KiB", "6291456", "off"."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10,
    "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
    "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30,
}  # fmt: skip
_OFF = {"OFF", "DISABLED", "NONE"}
_PATTERN = re.compile(r"(\d+)([A-Z]*)")


def parse_byte_size(text: str) -> int | None:
    """Parse a byte size; None means the path it configures is switched off.

    Accepts a non-negative integer, optionally followed by K, KB, KiB, M, MB, MiB, G, GB or GiB
    (all 1024-based, any case, whitespace anywhere ignored), or off / disabled / none.
    Raises ValueError quoting the text for anything else: negative numbers, fractions, unknown
    suffixes, empty strings.
    """
    if not isinstance(text, str):
        raise ValueError(f"byte size must be a string, got {type(text).__name__} {text!r}")
    compact = "".join(text.split()).upper()
    if compact in _OFF:
        return None
    match = _PATTERN.fullmatch(compact)
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(
            f"invalid byte size {text!r}: expected a non-negative integer with an optional "
            "K/KB/KiB/M/MB/MiB/G/GB/GiB suffix, or off/disabled/none"
        )
    return int(match.group(1)) * _UNITS[match.group(2)]


def format_byte_size(size: int | None) -> str:
    """The shortest exact spelling of `size` that parse_byte_size reads back ("off" for None)."""
    if size is None:
        return "off"
    for suffix, unit in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= unit and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)
