"""Table switches agreed through the control page (native/control.h, Communicator._agree_on_table):
at each switch point a rank reads every rank's offer of the point before and offers its own, with
no collective, so no call waits for a GPU. Whole groups switching together at the same call:
tests/test_live_thresholds.py."""

import threading

import pytest

from nodecomm import _native, host_memory

COMPLETE, ABORTED, TIMED_OUT = range(3)


@pytest.fixture
def control():
    fd = host_memory.create_segment("test:control", _native.CONTROL_BYTES)
    address = host_memory.map_segment(fd, _native.CONTROL_BYTES)
    yield address
    host_memory.unmap_segment(address, _native.CONTROL_BYTES)


def test_the_lowest_offer_of_a_point_once_every_rank_made_it(control):
    for rank, epoch in enumerate((7, 5, 9)):
        _native.publish_offer(control, rank, 1, epoch)
    assert _native.lowest_offer(control, 3, 1, 1.0) == (COMPLETE, 5, -1)


def test_a_point_waits_for_a_peer_behind_until_it_offers(control):
    _native.publish_offer(control, 0, 4, 3)
    late = threading.Timer(0.2, _native.publish_offer, (control, 1, 4, 2))
    late.start()
    try:
        assert _native.lowest_offer(control, 2, 4, 30.0) == (COMPLETE, 2, -1)
    finally:
        late.join()


def test_a_peer_that_never_offers_is_named_past_the_timeout(control):
    _native.publish_offer(control, 0, 1, 3)
    _native.publish_offer(control, 2, 1, 3)
    assert _native.lowest_offer(control, 3, 1, 0.05) == (TIMED_OUT, 0, 1)


def test_an_abort_ends_the_wait(control):
    _native.publish_offer(control, 0, 1, 3)
    abort = threading.Timer(0.1, _native.abort_group, (control, _native.AbortReason.PEER_LOST, 1))
    abort.start()
    try:
        assert _native.lowest_offer(control, 2, 1, 30.0) == (ABORTED, 0, 1)
    finally:
        abort.join()


def test_each_rank_keeps_two_points_and_the_third_takes_the_first_slot(control):
    """A rank rewrites its point-q slot at point q + 2, only after it read every rank's point q + 1
    offer, which each rank makes after reading the point-q ones: no reader loses an offer."""
    for point, epoch in ((1, 4), (2, 6)):
        _native.publish_offer(control, 0, point, epoch)
    assert _native.lowest_offer(control, 1, 1, 1.0) == (COMPLETE, 4, -1)
    assert _native.lowest_offer(control, 1, 2, 1.0) == (COMPLETE, 6, -1)
    _native.publish_offer(control, 0, 3, 8)
    assert _native.lowest_offer(control, 1, 3, 1.0) == (COMPLETE, 8, -1)
    assert _native.lowest_offer(control, 1, 1, 0.01) == (TIMED_OUT, 0, 0)
    assert _native.lowest_offer(control, 1, 2, 1.0) == (COMPLETE, 6, -1)
