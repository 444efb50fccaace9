"""Waiting for something another process does: the daemon, a rank, a child.

A test waits on the event itself, polled, never on a sleep that guesses how long it takes. The
timeout is there so that a broken daemon fails the test instead of hanging it: it is generous and
measures nothing, unless a test says why a bound is part of what it shows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_SECONDS = 0.05


def wait_until(condition: Callable[[], T], timeout: float, what: str | Callable[[], str]) -> T:
    """Poll `condition` until it returns a true value, and return that value. Past `timeout`
    seconds, fail the test with `what` (the event that did not happen; a callable is asked at that
    moment, to describe the state it was left in). An exception from `condition` ends the wait."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what() if callable(what) else what}: not within {timeout} s")
        time.sleep(POLL_SECONDS)
    return value
