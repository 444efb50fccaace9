"""How the ranks of a group agree on a new dispatch table with no collective: at every table switch
point each rank switches to the lowest epoch the ranks offered at the point before (which every
rank holds), then offers the newest it holds, on the group's control page (native/control.h). No
call waits for a GPU, nor for a peer unless its host is a whole table_switch_period behind."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from nodecomm import _native
from nodecomm.errors import DeadlineExceededError, InternalError

from .membership import Membership

if TYPE_CHECKING:
    from nodecomm.thresholds import DispatchTable

    from .dispatch import Dispatcher

log = logging.getLogger("nodecomm.client")

# How the wait for the ranks' offers ended (native/control.h, OfferWait).
_COMPLETE, _ABORTED, _TIMED_OUT = range(3)


class TableOffers:
    def __init__(self, control_address: int, membership: Membership, timeout: float):
        self._control = control_address
        self._membership = membership
        self._timeout = timeout
        self._point = 0  # switch points passed: the same on every rank, which make the same calls

    def lowest_of_ranks(self, newest: int, current: int) -> int:
        """At the next switch point: offer `newest` (the newest epoch this rank holds) and return
        the lowest the ranks offered at the point before (`current`, the epoch in force, at the
        first). Called under the communicator's call lock, on a group not known to be aborted.
        A peer that has not offered within the operation timeout stalled: the group aborts, as
        after a collective's wait that ran out, and DeadlineExceededError names it; on another
        rank's abort, InternalError (the caller raises the abort's own error first)."""
        self._point += 1
        point, where = self._point, self._membership.where
        lowest = current
        if point > 1:
            outcome, lowest, missing = _native.lowest_offer(
                self._control, self._membership.world_size, point - 1, self._timeout
            )
            if outcome == _TIMED_OUT:
                _native.abort_group(self._control, _native.AbortReason.STALLED, self._membership.rank)
                raise DeadlineExceededError(
                    f"waited {self._timeout:.1f} s for rank {missing} at table switch point {point - 1}", **where
                )
            if outcome != _COMPLETE:
                raise InternalError("the group aborted during a table switch", **where)
        _native.publish_offer(self._control, self._membership.rank, point, newest)
        return lowest

    def agree(
        self,
        dispatcher: Dispatcher,
        offered: dict[int, DispatchTable],
        withheld: Collection[int],
        lock: _native.CallLock,
        check_usable: Callable[[], None],
    ) -> None:
        """At a switch point: switch `dispatcher` to the table the ranks agreed on, if a newer one
        (`offered`: the tables this rank holds, by epoch; `withheld`: epochs it holds but offers no
        more, Session.withheld). Under `lock`, on a group `check_usable()` finds usable; an abort
        raises its own error."""

        def lowest_of_ranks(newest: int) -> int:
            with lock:
                check_usable()
                try:
                    return self.lowest_of_ranks(newest, dispatcher.table.epoch)
                except InternalError:
                    check_usable()  # the abort's own error
                    raise

        try:
            agreed = dispatcher.agree(offered, lowest_of_ranks, withheld)
        except InternalError as error:
            raise error.located(**self._membership.where) from None
        if agreed is not None:
            log.info("dispatch table switched", extra={**self._membership.where, "epoch": agreed})
