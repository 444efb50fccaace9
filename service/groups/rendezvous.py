"""One meeting of a group's ranks in the daemon: a Join, a stage of the peer check, a top-k
exchange's opening, a service-path collective. Every rank arrives once; the fields the ranks must
agree on are compared as they arrive, with one message that names each rank's value; once every
rank is there one decision answers them all, with a result each or one error for all; and a rank
that stops waiting (its deadline, its cancelled call) either withdraws alone, takes every rank
down with it, or leaves its arrival standing, as its kind of meeting needs.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar

from nodecomm.errors import AlreadyExistsError, NodecommError

Arrival = TypeVar("Arrival")  # what a rank arrives with
Result = TypeVar("Result")  # what each rank gets back


class OnStop(enum.Enum):
    """What a rank that stops waiting before the decision does to the meeting."""

    WITHDRAW = "withdraw"  # its arrival goes; the others keep waiting (a Join)
    FAIL_ALL = "fail_all"  # every rank gets the error (an exchange or collective cannot go on without it)
    STAND = "stand"  # its arrival stays, and its peers may still be decided (a peer check)


def each_rank(values: Mapping[int, object]) -> str:
    """'rank 0 has 4096, rank 1 has 8192': what a mismatch message says of each rank."""
    return ", ".join(f"rank {rank} has {value}" for rank, value in sorted(values.items()))


class Rendezvous(Generic[Arrival, Result]):
    """The meeting of `world_size` ranks. `agreed` names the fields every arrival must have
    equal, read with `shown(arrival, name)` (getattr by default) as they are shown in messages."""

    def __init__(
        self,
        world_size: int,
        agreed: Sequence[str] = (),
        shown: Callable[[Arrival, str], object] = getattr,
    ):
        self.world_size = world_size
        self.arrivals: dict[int, Arrival] = {}
        self.gave_up: set[int] = set()  # ranks that arrived, then withdrew, and have not come back
        self.failure: NodecommError | None = None
        self._agreed = agreed
        self._shown = shown
        self._answers: dict[int, asyncio.Future[Result]] = {}

    @property
    def complete(self) -> bool:
        return len(self.arrivals) == self.world_size

    def missing(self) -> list[int]:
        return sorted(set(range(self.world_size)) - set(self.arrivals))

    def arrive(self, rank: int, arrival: Arrival, duplicate: str, where: dict) -> tuple[str, str] | None:
        """Add `rank`'s arrival. A second one from it is refused with AlreadyExistsError(duplicate);
        one that differs from the earlier arrivals on an agreed field is not added, and that field
        and each rank's value of it are returned ("count", "rank 0 has 4096, rank 1 has 8192")."""
        if rank in self.arrivals:
            raise AlreadyExistsError(duplicate, **where)
        for name in self._agreed:
            values = {r: self._shown(a, name) for r, a in self.arrivals.items()}
            values[rank] = self._shown(arrival, name)
            if len(set(values.values())) > 1:
                return name, each_rank(values)
        self.arrivals[rank] = arrival
        self.gave_up.discard(rank)
        answer = self._answers[rank] = asyncio.get_running_loop().create_future()
        # A rank that stopped waiting no longer awaits its answer: its outcome is retrieved here.
        answer.add_done_callback(lambda done: done.cancelled() or done.exception())
        if self.failure is not None:
            answer.set_exception(self.failure)  # the meeting failed before this rank came
        return None

    def waiting(self) -> bool:
        """Whether a rank still waits for its answer."""
        return any(not answer.done() for answer in self._answers.values())

    def answered(self, rank: int) -> bool:
        answer = self._answers.get(rank)
        return answer is not None and answer.done()

    def succeed(self, results: Mapping[int, Result]) -> None:
        """Answer every waiting rank with its result."""
        for rank, answer in self._answers.items():
            if not answer.done():
                answer.set_result(results[rank])

    def fail(self, error: NodecommError) -> None:
        """Every waiting rank, and every later arrival, gets `error` (the first failure stays)."""
        if self.failure is None:
            self.failure = error
        for answer in self._answers.values():
            if not answer.done():
                answer.set_exception(self.failure)

    def withdraw(self, rank: int) -> None:
        """Take back `rank`'s arrival, unless it was answered."""
        if not self.answered(rank) and rank in self.arrivals:
            del self.arrivals[rank]
            self._answers.pop(rank, None)
            self.gave_up.add(rank)

    async def wait(
        self,
        rank: int,
        timeout: float,
        on_stop: OnStop,
        timed_out: Callable[[list[int]], NodecommError],
        stopped: Callable[[], NodecommError] | None = None,
        deciding: Callable[[], bool] = lambda: False,
    ) -> Result:
        """`rank`'s answer, within `timeout` seconds. Past it, `timed_out(missing ranks)` is the
        error, for this rank alone or for all (on_stop); a cancelled wait withdraws this rank, or
        fails all with `stopped()`. While `deciding()` holds, the decision is under way and
        bounded: the wait goes on for it instead."""
        answer = self._answers[rank]
        try:
            return await asyncio.wait_for(asyncio.shield(answer), timeout)
        except asyncio.TimeoutError:
            if answer.done() or deciding():  # answered in the step the deadline passed, or about to be
                return await answer
            error = timed_out(self.missing())
            if on_stop is OnStop.FAIL_ALL:
                self.fail(error)
                raise self.failure from None
            if on_stop is OnStop.WITHDRAW:
                self.withdraw(rank)
            raise error from None
        except asyncio.CancelledError:
            if not answer.done() and not deciding():
                if on_stop is OnStop.WITHDRAW:
                    self.withdraw(rank)
                elif on_stop is OnStop.FAIL_ALL and stopped is not None:
                    self.fail(stopped())
            raise
