"""The rank harness the benches and the tests share (nodecomm.tools.ranks), on real processes."""

from __future__ import annotations

import os
import time

import pytest

from nodecomm.tools.ranks import RankProcesses, RanksFailed


def parts_then_value(rank: int, parts: int, report) -> int:
    for part in range(parts):
        report((rank, part))
    return rank * 10


def one_raises(rank: int) -> str:
    if rank == 1:
        raise ValueError("rank 1 was given a bad input")
    time.sleep(600)  # killed by close(): the failure is reported without waiting for this rank
    return "slept"


def exits_without_a_word(rank: int, code: int) -> None:
    os._exit(code)


def sleeps(rank: int, seconds: float) -> None:
    time.sleep(seconds)


def test_parts_arrive_in_order_before_every_rank_s_value():
    seen: list[tuple[int, int]] = []
    with RankProcesses.start(parts_then_value, 2, 3, report=True, timeout=120) as ranks:
        assert ranks.values(on_part=seen.append) == {0: 0, 1: 10}
    for rank in (0, 1):
        assert [part for r, part in seen if r == rank] == [0, 1, 2]


def test_the_first_failure_ends_the_wait_with_its_traceback():
    with RankProcesses.start(one_raises, 2, timeout=300) as ranks:
        with pytest.raises(RanksFailed) as failed:
            ranks.values(first_failure=True)
        assert ranks.processes[0].is_alive()  # still asleep: nobody waited for it
    message = str(failed.value)
    assert "rank 1 error" in message and "ValueError: rank 1 was given a bad input" in message
    assert "rank 0" not in message


def test_every_failure_is_reported_without_first_failure():
    with RankProcesses.start(exits_without_a_word, [0, 1], 3, timeout=120) as ranks:
        assert ranks.results() == {0: ("died", 3), 1: ("died", 3)}
    with RankProcesses.start(exits_without_a_word, 2, 3, timeout=120) as ranks:
        with pytest.raises(RanksFailed, match="rank 0 died: exit code 3\nrank 1 died: exit code 3"):
            ranks.values()


def test_a_rank_past_the_deadline_is_named():
    with RankProcesses.start(sleeps, 2, 600.0, timeout=2) as ranks:
        with pytest.raises(RanksFailed, match=r"ranks \[0, 1\] did not finish before the deadline"):
            ranks.results()
