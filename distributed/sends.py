"""SendLedger: who has sent what to whom, so that a receive from any source finds its sender.

Sends and receives run on pair groups, one nodecomm group per (source, destination, tag), so a
receive must name its source. Every send also counts itself in the process group's store under
(source, destination, tag); every receiver counts the receives it has issued per (source, tag).
A receive from any source waits until some source has sent more than this rank has taken from it,
takes the lowest such rank, and receives from it on that pair's group. Messages of one pair keep
their order, so counts are all that must agree: whichever receive takes a count, the pair's group
hands out that pair's messages first in, first out.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from nodecomm.errors import DeadlineExceededError, InvalidArgumentError

# How long a receive from any source sleeps between looks at the store, at first and at most.
_FIRST_LOOK_S = 0.0005
_LONGEST_LOOK_S = 0.05


class SendLedger:
    def __init__(self, store: dist.Store, prefix: str, rank: int, size: int, timeout_s: float):
        self._store = store
        self._prefix = prefix
        self._rank = rank
        self._size = size
        self._timeout_s = timeout_s
        self._lock = threading.Lock()  # guards _taken: receives are issued from any thread
        self._taken: dict[tuple[int, int], int] = {}  # (source, tag) -> receives issued
        self._closed = threading.Event()  # the process group is shut down: claims end

    def _key(self, source: int, destination: int, tag: int) -> str:
        return f"{self._prefix}/sent/{source}/{destination}/{tag}"

    def sent(self, destination: int, tag: int) -> None:
        """Count a send of this rank's (one store round trip)."""
        self._store.add(self._key(self._rank, destination, tag), 1)

    def taken(self, source: int, tag: int) -> None:
        """Count a receive that names its source."""
        with self._lock:
            self._taken[(source, tag)] = self._taken.get((source, tag), 0) + 1

    def close(self) -> None:
        """End every claim waiting for a sender, now and later (the process group is shut down)."""
        self._closed.set()

    def claim(self, tag: int) -> int:
        """The rank whose send (with `tag`) the next receive from any source takes, counted as
        taken; waits for one up to the group's timeout (then DeadlineExceededError), or until
        close() (then InvalidArgumentError)."""
        deadline = time.monotonic() + self._timeout_s
        pause = _FIRST_LOOK_S
        while True:
            for source in range(self._size):
                if source == self._rank:
                    continue
                sent = self._store.add(self._key(source, self._rank, tag), 0)  # adding 0 reads the count
                with self._lock:
                    taken = self._taken.get((source, tag), 0)
                    if sent > taken:
                        self._taken[(source, tag)] = taken + 1
                        return source
            if time.monotonic() >= deadline:
                raise DeadlineExceededError(
                    f"rank {self._rank}: no rank sent it a message with tag {tag} within the group's "
                    f"timeout ({self._timeout_s:g} s) for a receive from any source"
                )
            if self._closed.wait(pause):
                raise InvalidArgumentError(
                    f"rank {self._rank}: the process group was shut down (destroy_process_group or abort) while "
                    f"a receive from any source waited for a message with tag {tag}"
                )
            pause = min(pause * 2, _LONGEST_LOOK_S)
