"""The Rendezvous every meeting of ranks in the daemon goes through, without a daemon: arrivals
compared field by field, one answer or one error for all, and what a rank that stops waiting does
to the others under each OnStop."""

import asyncio
from dataclasses import dataclass

import pytest

from nodecomm.errors import AlreadyExistsError, DeadlineExceededError, PeerLostError
from nodecomm.service.groups.rendezvous import OnStop, Rendezvous

WHERE: dict = {}


@dataclass(frozen=True)
class Call:
    count: int
    dtype: str


def timed_out(missing: list[int]) -> DeadlineExceededError:
    return DeadlineExceededError(f"ranks {missing} did not come")


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


def test_every_rank_gets_its_result_once_all_arrived():
    async def meet():
        meeting: Rendezvous[Call, int] = Rendezvous(3, ("count", "dtype"))
        waits = []
        for rank in range(3):
            assert meeting.arrive(rank, Call(4096, "bf16"), f"rank {rank} again", WHERE) is None
            waits.append(asyncio.ensure_future(meeting.wait(rank, 5, OnStop.FAIL_ALL, timed_out)))
        await asyncio.sleep(0)
        assert meeting.complete and meeting.waiting()
        meeting.succeed({rank: rank * 10 for rank in range(3)})
        return await asyncio.gather(*waits), meeting.waiting()

    assert run(meet()) == ([0, 10, 20], False)


def test_a_disagreeing_arrival_names_the_field_and_each_ranks_value_and_is_not_added():
    async def meet():
        meeting: Rendezvous[Call, int] = Rendezvous(3, ("count", "dtype"))
        meeting.arrive(0, Call(4096, "bf16"), "", WHERE)
        meeting.arrive(1, Call(4096, "bf16"), "", WHERE)
        differs = meeting.arrive(2, Call(8192, "bf16"), "", WHERE)
        with pytest.raises(AlreadyExistsError, match="rank 1 again"):
            meeting.arrive(1, Call(4096, "bf16"), "rank 1 again", WHERE)
        return differs, sorted(meeting.arrivals)

    assert run(meet()) == (("count", "rank 0 has 4096, rank 1 has 4096, rank 2 has 8192"), [0, 1])


def test_a_failure_reaches_every_waiting_rank_and_every_later_arrival():
    async def meet():
        meeting: Rendezvous[Call, int] = Rendezvous(3)
        meeting.arrive(0, Call(1, "f32"), "", WHERE)
        first = asyncio.ensure_future(meeting.wait(0, 5, OnStop.FAIL_ALL, timed_out))
        await asyncio.sleep(0)
        meeting.fail(PeerLostError("group aborted: rank 2 lost"))
        meeting.fail(PeerLostError("a later failure"))  # the first one stays
        meeting.arrive(1, Call(1, "f32"), "", WHERE)
        assert not meeting.waiting()  # what an abort checks before it fails a meeting
        errors = []
        for wait in (first, meeting.wait(1, 5, OnStop.FAIL_ALL, timed_out)):
            with pytest.raises(PeerLostError) as caught:
                await wait
            errors.append(str(caught.value))
        return errors

    assert run(meet()) == ["group aborted: rank 2 lost"] * 2


@pytest.mark.parametrize(
    "on_stop, others_fail, arrivals_left",
    [(OnStop.WITHDRAW, False, [1]), (OnStop.FAIL_ALL, True, [0, 1]), (OnStop.STAND, False, [0, 1])],
)
def test_a_rank_past_its_deadline(on_stop, others_fail, arrivals_left):
    async def meet():
        meeting: Rendezvous[Call, int] = Rendezvous(3)
        meeting.arrive(0, Call(1, "f32"), "", WHERE)
        meeting.arrive(1, Call(1, "f32"), "", WHERE)
        other = asyncio.ensure_future(meeting.wait(1, 5, on_stop, timed_out))
        with pytest.raises(DeadlineExceededError, match=r"ranks \[2\] did not come"):
            await meeting.wait(0, 0.05, on_stop, timed_out)
        await asyncio.wait([other], timeout=0.5)
        failed = other.done() and isinstance(other.exception(), DeadlineExceededError)
        other.cancel()
        return failed, sorted(meeting.arrivals)

    assert run(meet()) == (others_fail, arrivals_left)


def test_a_cancelled_wait_withdraws_or_fails_all_as_its_meeting_needs():
    async def meet(on_stop: OnStop):
        meeting: Rendezvous[Call, int] = Rendezvous(2)
        meeting.arrive(0, Call(1, "f32"), "", WHERE)
        waiting = asyncio.ensure_future(
            meeting.wait(0, 5, on_stop, timed_out, stopped=lambda: PeerLostError("rank 0's call was cancelled"))
        )
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        return sorted(meeting.arrivals), str(meeting.failure) if meeting.failure else None

    assert run(meet(OnStop.WITHDRAW)) == ([], None)
    assert run(meet(OnStop.FAIL_ALL)) == ([0], "rank 0's call was cancelled")
