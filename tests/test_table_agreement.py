"""Table switches agreed through the control page (native/control.h, Communicator._agree_on_table):
at each switch point a rank reads every rank's offer of the point before and offers its own, with
no collective, so no call waits for a GPU. Whole groups switching together at the same call:
tests/test_live_thresholds.py."""

import functools
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


def _table(epoch: int):
    from nodecomm.thresholds import DispatchTable, Path

    return DispatchTable(epoch=epoch, range_max=(), range_paths=(Path.TWOSHOT,))


def _two_ranks_after_a_daemon_loss(control, withheld: bool) -> list:
    """Two ranks on epoch 7. The daemon that offered epoch 8 died after rank 0 received it and
    before rank 1 did (rank 0's session withholds it, unless `withheld` is False); the next daemon
    numbers its tables from the next block (TableKeeper.adopt_epoch) and its first reaches rank 1
    before rank 0's next switch point. Each rank's switch points, in turn: what each ended on, or
    what it raised."""
    from nodecomm.client.dispatch import Dispatcher
    from nodecomm.client.membership import Membership
    from nodecomm.client.table_offers import TableOffers
    from nodecomm.service.calibration.tables import EPOCH_BLOCK
    from nodecomm.thresholds import Path

    ranks = []
    for rank in range(2):
        dispatcher = Dispatcher(_table(7), frozenset({Path.ONESHOT, Path.TWOSHOT}), "cpu")
        offers = TableOffers(control, Membership("g", 1, rank, 2), 1.0)
        ranks.append((dispatcher, offers, {}, set()))
    ranks[0][2][8] = _table(8)
    if withheld:
        ranks[0][3].add(8)
    ranks[1][2][EPOCH_BLOCK] = _table(EPOCH_BLOCK)
    ended = [None, None]
    for point in range(3):
        for rank, (dispatcher, offers, offered, withholding) in enumerate(ranks):
            if ended[rank] is not None:
                continue
            try:
                lowest = functools.partial(lambda e, o, d: o.lowest_of_ranks(e, d.table.epoch), o=offers, d=dispatcher)
                dispatcher.agree(offered, lowest, withholding)
            except Exception as error:
                ended[rank] = f"{type(error).__name__}: {error}"
        if point == 0:
            ranks[0][2][EPOCH_BLOCK] = _table(EPOCH_BLOCK)  # the next daemon's table reaches rank 0 too
    return [ended[rank] or dispatcher.table.epoch for rank, (dispatcher, *_) in enumerate(ranks)]


def test_after_a_daemon_loss_no_rank_offers_a_table_a_peer_never_received(control):
    """A table the lost daemon offered is withheld (client/session.py): the ranks agree on the next
    daemon's first table instead. Offered, it would be agreed on, and rank 1, which never received
    it, says so (it once raised KeyError and stayed behind)."""
    from nodecomm.service.calibration.tables import EPOCH_BLOCK

    assert _two_ranks_after_a_daemon_loss(control, withheld=True) == [EPOCH_BLOCK, EPOCH_BLOCK]


def test_a_table_a_rank_never_received_is_named_when_the_ranks_agree_on_it(control):
    from nodecomm.service.calibration.tables import EPOCH_BLOCK

    ended = _two_ranks_after_a_daemon_loss(control, withheld=False)
    assert ended[0] == EPOCH_BLOCK, ended  # by way of 8, which rank 1 could not take
    assert ended[1].startswith("InternalError: the ranks agreed on dispatch table epoch 8, which this rank never"), (
        ended
    )
    assert f"(it holds [{EPOCH_BLOCK}]); it stays on epoch 7" in ended[1], ended


def test_a_table_pushed_under_an_epoch_a_rank_holds_does_not_replace_it(control):
    """Two adoptions in a row: the second daemon pushed epoch 2^32 and both ranks offered it before
    that daemon died; the third, adopting the group from a rank whose table in force was still
    epoch 7, numbered its own first table 2^32 too and pushed it to rank 0 first. Both ranks switch
    to the table they offered under that epoch: rank 0 keeps the one it holds (it once took the
    new one in its place, and the ranks ran different tables under one epoch)."""
    from nodecomm.client.dispatch import Dispatcher
    from nodecomm.client.membership import Membership
    from nodecomm.client.session import Session
    from nodecomm.client.table_offers import TableOffers
    from nodecomm.service.calibration.tables import EPOCH_BLOCK
    from nodecomm.thresholds import DispatchTable, Path

    def table(path: Path) -> DispatchTable:
        return DispatchTable(epoch=EPOCH_BLOCK, range_max=(), range_paths=(path,))

    ranks = []
    for rank in range(2):
        membership = Membership("g", 1, rank, 2)
        session = Session(None, membership, control, None)
        session.take_offer(table(Path.TWOSHOT))
        dispatcher = Dispatcher(_table(7), frozenset({Path.ONESHOT, Path.TWOSHOT}), "cpu")
        ranks.append((session, dispatcher, TableOffers(control, membership, 1.0)))
    for _, dispatcher, offers in ranks:  # the point before the loss: both offer 2^32
        assert offers.lowest_of_ranks(EPOCH_BLOCK, dispatcher.table.epoch) == 7
    for session, _, _ in ranks:
        session.withheld.update(session.offered)  # the stream is lost (Session._stream)
    ranks[0][0].take_offer(table(Path.ONESHOT))  # the third daemon's, under the same epoch
    for session, dispatcher, offers in ranks:
        assert dispatcher.agree(session.offered, functools.partial(offers.lowest_of_ranks, current=7), session.withheld)
    assert [dispatcher.table.range_paths for _, dispatcher, _ in ranks] == [(Path.TWOSHOT,)] * 2


def test_an_adopting_daemon_numbers_its_tables_past_every_epoch_the_one_before_could_offer():
    """The daemon before may have offered epochs past the adopted group's table that some of its
    ranks hold: the next daemon's tables start at the next block of epochs, for every group."""
    from nodecomm.service.calibration.tables import EPOCH_BLOCK, TableKeeper
    from nodecomm.service.config import DaemonConfig
    from nodecomm.service.metrics.families import DaemonMetrics
    from nodecomm.thresholds import Wire

    keeper = TableKeeper(DaemonConfig(), DaemonMetrics(), 8)
    assert keeper.for_new_group("cpu", False, {}, Wire.LOSSLESS).epoch == 1
    keeper.adopt_epoch(7)
    assert keeper.for_new_group("cpu", False, {}, Wire.LOSSLESS).epoch == EPOCH_BLOCK
    keeper.adopt_epoch(5)  # another group, adopted from the same daemon before: no new block
    assert keeper.for_new_group("cpu", False, {}, Wire.LOSSLESS).epoch == EPOCH_BLOCK + 1
    keeper.adopt_epoch(EPOCH_BLOCK + 3)  # a group adopted twice
    assert keeper.for_new_group("cpu", False, {}, Wire.LOSSLESS).epoch == 2 * EPOCH_BLOCK
