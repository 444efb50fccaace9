"""The `nodecomm` command's argument types: each refusal says what was expected."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from nodecomm.byte_size import parse_byte_size

# The largest size a bench or a calibration measures by default, per device.
DEFAULT_MAX = {"cpu": "64MiB", "cuda": "256MiB"}


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds greater than 0."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds, e.g. 5") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds greater than 0")
    return seconds


def byte_size(text: str) -> int:
    """An argparse type: a byte size (parse_byte_size's forms, not "off"), at least 1."""
    expected = f"{text!r}: expected a size of at least 1 byte, e.g. 4KiB or 1048576 (K, M, G: 1024-based)"
    try:
        size = parse_byte_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(expected) from None
    if size is None or size < 1:
        raise argparse.ArgumentTypeError(expected)
    return size


def byte_sizes(text: str) -> list[int]:
    """An argparse type: comma-separated byte sizes."""
    return sorted({byte_size(part.strip()) for part in text.split(",") if part.strip()}) or [byte_size("")]


def whole_number(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: one whole number from `minimum` (to `maximum`)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"from {minimum} to {maximum}" if maximum is not None else f"{minimum} or more"
            raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number {bound}")
        return value

    return parse


def whole_numbers(minimum: int) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated whole numbers, each at least `minimum`."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(value) for value in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated whole numbers, e.g. 2,2") from None
        if min(values) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: expected every number to be {minimum} or more")
        return values

    return parse
