"""The errors a rank's calls on its group raise: an abort read from the group's control page in
this process (no device synchronisation, no call to the daemon), told with what only this side
knows: the daemon's words for a lost peer, every rank's record of a mismatch, a peer whose
process has ended behind a wait that ran out."""

from __future__ import annotations

from nodecomm import _native
from nodecomm.capabilities import DeviceKind
from nodecomm.errors import (
    DeadlineExceededError,
    GroupMismatchError,
    InvalidArgumentError,
    NodecommError,
    PeerLostError,
)

from .cuda_transport import mismatch_error
from .membership import Membership
from .peer_liveness import PeerLiveness
from .session import Session


class GroupErrors:
    def __init__(
        self,
        control_address: int,
        membership: Membership,
        kind: DeviceKind,
        session: Session,
        liveness: PeerLiveness | None,
    ):
        self._control_address = control_address
        self._membership = membership
        self._kind = kind
        self._session = session
        self.liveness = liveness  # tells a peer that is gone from one that is slow, with or without a daemon
        # This rank set the abort word (Communicator.abort): its lanes' errors, read after the
        # control page may be gone, say so.
        self.aborted_here = False

    def check(self, closed: bool, call_follows: bool = False) -> None:
        """Raise why the communicator cannot be used. With `call_follows`, a group that a mismatch
        stopped (only CUDA kernels abort with one) is left to the transport, which records the call
        this rank was about to make before it raises (the call its peers disagreed on, where its
        kernels never ran it)."""
        if closed:
            raise InvalidArgumentError("this communicator is closed", **self._membership.where)
        reason, detail = _native.abort_state(self._control_address)
        if reason == _native.AbortReason.MISMATCH and call_follows:
            return
        if reason:
            raise self._aborted(reason, detail)

    def located(self, error: NodecommError) -> NodecommError:
        """`error`, naming this group and rank; a wait that ran out names a peer that has ended."""
        if self.aborted_here and isinstance(error, PeerLostError):  # the abort word this rank set
            return self._own_abort()
        if isinstance(error, DeadlineExceededError):
            error = self._lost_peer() or error
        return error.located(**self._membership.where)

    def of_lane(self, error: NodecommError) -> NodecommError:
        """A lane's error, located; a CUDA group that a mismatch stopped says what every rank called."""
        if isinstance(error, GroupMismatchError) and self._kind == DeviceKind.CUDA:
            error = mismatch_error(self._control_address, self._membership.world_size)
        return self.located(error)

    def _aborted(self, reason: int, detail: int) -> NodecommError:
        """The error of an abort (native/control.h's abort_error)."""
        where = self._membership.where
        if reason == _native.AbortReason.MISMATCH:
            return mismatch_error(self._control_address, self._membership.world_size, **where)
        if reason == _native.AbortReason.PEER_LOST and self._session.event_message:
            return PeerLostError(f"group aborted: {self._session.event_message}", **where)
        if reason == _native.AbortReason.PEER_LEFT and detail == self._membership.rank:  # its abort()
            return self._own_abort()
        if reason == _native.AbortReason.STALLED:
            lost = self._lost_peer()
            if lost is not None:
                return self.located(lost)
        return self.located(_native.error(*_native.abort_error(self._control_address, reason, detail)))

    def _own_abort(self) -> InvalidArgumentError:
        return InvalidArgumentError(
            "this rank aborted the group (abort()): its calls under way end here", **self._membership.where
        )

    def _lost_peer(self) -> PeerLostError | None:
        """For a wait that ran out: PeerLostError where a peer's process has ended (peer_liveness.py)."""
        if self.liveness is None:
            return None
        me = self._membership.rank
        gone = [r for r in range(self._membership.world_size) if r != me and self.liveness.gone(r)]
        if not gone:
            return None
        return PeerLostError(f"group aborted: peer rank {gone[0]} was lost (its process has ended)")

    def close(self) -> None:
        if self.liveness is not None:
            self.liveness.close()
