"""The tests' one way to wait: the value that ended the wait, or a failure naming what did not happen."""

import itertools

import pytest

from waiting import wait_until


def test_the_wait_returns_the_value_that_ended_it():
    calls = itertools.count(1)
    assert wait_until(lambda: (n := next(calls)) >= 3 and n, 10, "the third call") == 3


def test_a_wait_past_its_timeout_names_what_did_not_happen_and_the_state_it_left():
    state = {"joined": 1}
    with pytest.raises(AssertionError, match=r"both ranks joined \(now 1\): not within 0.2 s"):
        wait_until(lambda: state["joined"] == 2, 0.2, lambda: f"both ranks joined (now {state['joined']})")


def test_an_error_in_the_condition_ends_the_wait_at_once():
    def dead() -> bool:
        raise AssertionError("the daemon exited with 1")

    with pytest.raises(AssertionError, match="the daemon exited with 1"):
        wait_until(dead, 3600, "the daemon serving")
