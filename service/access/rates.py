"""Rates per caller: a token bucket (a rank's timings a second) and paces (how fast a session's
messages are read, and all of one caller's sessions together)."""

from __future__ import annotations

import asyncio
import time

from nodecomm.service.access.callers import Caller

# What one slot of a session's pace holds (a client's batch of 32 timings is about 600 bytes): a
# longer message takes a slot per PACE_BYTES, so a pace bounds the bytes it reads as well.
PACE_BYTES = 1024


class TokenBucket:
    """`rate` tokens a second on average, as many at once."""

    def __init__(self, rate: float):
        self.rate = rate
        self._tokens = rate
        self._at = time.monotonic()

    def take(self, wanted: int) -> int:
        """Up to `wanted` tokens, as many as there are."""
        now = time.monotonic()
        self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
        self._at = now
        granted = min(wanted, int(self._tokens))
        self._tokens -= granted
        return granted


class Pace:
    """Slots at `rate` a second on average, a second's worth at once: each wait() takes the next
    free `slots` (a message's: one, or more for a long one) and sleeps until they start, so
    waiters wake once each, in turn, however many there are."""

    def __init__(self, rate: float):
        self.rate = rate
        self._next = time.monotonic()

    async def wait(self, slots: float = 1.0) -> None:
        now = time.monotonic()
        slot = max(self._next, now - 1.0)
        self._next = slot + slots / self.rate
        if slot > now:
            await asyncio.sleep(slot - now)


class CallerPaces:
    """One Pace of `rate` a second per caller, made on first use: what all of a caller's sessions
    share, so that many of them cost the daemon no more than one caller's share."""

    def __init__(self, rate: float):
        self.rate = rate
        self._paces: dict[Caller, Pace] = {}

    def of(self, caller: Caller) -> Pace:
        pace = self._paces.get(caller)
        if pace is None:
            pace = self._paces[caller] = Pace(self.rate)
        return pace
