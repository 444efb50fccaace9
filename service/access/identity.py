"""Who a call comes from, and what that caller may do: the connection's peer as the gate read it,
a Join's uid (the connection's, or an identity from the descriptor socket), operator calls, and
a member's rank secret."""

from __future__ import annotations

import grpc

from nodecomm.credentials import RANK_SECRET_KEY
from nodecomm.errors import PermissionDeniedError
from nodecomm.service.access.callers import Caller, Peer
from nodecomm.service.access.connections import Gate
from nodecomm.service.memory.handles import Admission, IdentityTable, is_declared_process, process_uid
from nodecomm.v1 import control_pb2 as pb


class Identity:
    """The daemon's identity policy, which the servicer asks before it acts on a call."""

    def __init__(self, gate: Gate, identities: IdentityTable, admission: Admission):
        self.gate = gate
        self.identities = identities
        self.admission = admission

    def peer(self, context: grpc.aio.ServicerContext) -> Peer:
        """Who makes this call, as the gate read it when the connection arrived (connections.py)."""
        found = self.gate.peer_of(context.peer())
        if found is None:
            raise PermissionDeniedError("this call did not come through the daemon's sockets; connect to its socket")
        return found

    def _identified_uid(self, token: bytes, pid: int, **where) -> int:
        """The uid an identity from the descriptor socket proves, for the process that declares `pid`."""
        identity = self.identities.take(token)
        if identity is None:
            raise PermissionDeniedError("unknown, already used or expired identity token", **where)
        if not is_declared_process(identity.pid, pid):
            raise PermissionDeniedError(
                f"the identity was issued to pid {identity.pid}, but this request declares pid {pid}", **where
            )
        return identity.uid

    def check_operator(self, caller: Caller) -> None:
        """Calibrate changes the boundaries of every new group on the node: operator uids only."""
        if caller.uid is None or not self.admission.operates(caller.uid):
            who = sorted(self.admission.operators) or "root and the daemon's own uid"
            raise PermissionDeniedError(
                f"{caller} may not calibrate: calibrating changes every new group's boundaries, which "
                f"only operator uids ({who}) may (the daemon's operator_uids)"
            )

    def joining_uid(self, request: pb.JoinRequest, peer: Peer) -> int:
        """Who joins, a uid the group's claims are then bound to: the connection's, which an
        identity presented with it (issued on the descriptor socket to the very process that
        declares its pid) must agree with. Without an identity, the declared pid must be a process
        of that uid: the connection's own process on Unix. Over TCP, an identity names a caller the
        connection could not (beyond loopback, where a Join without one is refused: no claim
        could succeed), and is required where the daemon admits only some uids (the gate checked
        Unix callers as they connected). A Join over TCP also needs a group key: whoever reaches
        the port may be anyone."""
        where = dict(group=request.group or None, rank=request.rank)
        caller, transport = peer.caller, peer.transport
        if transport == "tcp" and not request.group_key:
            raise PermissionDeniedError(
                "a Join over TCP must carry a group key: pass connect(group_key=...) or set NODECOMM_GROUP_KEY, "
                "the same on every rank (or connect through the daemon's Unix socket)",
                **where,
            )
        if request.identity:
            uid = self._identified_uid(request.identity, request.pid, **where)
            if caller.uid is not None and uid != caller.uid:
                raise PermissionDeniedError(
                    f"the identity was issued to uid {uid}, but this Join comes from {caller}", **where
                )
            return uid
        if transport == "tcp" and (self.admission.required or caller.uid is None):
            why = (
                "this daemon admits only some uids and groups"
                if caller.uid is not None
                else "the daemon cannot tell which local user calls over TCP beyond loopback, and hands memory only "
                "to the uid that joined"
            )
            raise PermissionDeniedError(
                f"{why}: a Join over TCP must carry the identity the descriptor socket issues (send IDENTIFY "
                "there first), or come through the daemon's Unix socket",
                **where,
            )
        if request.pid <= 0 or (peer.pid is not None and is_declared_process(peer.pid, request.pid)):
            return caller.uid  # the connection's own process (a pid that is none: validate_join says so)
        declared = process_uid(request.pid)
        if declared != caller.uid:
            runs_as = "is no process the daemon can see" if declared is None else f"runs as {Caller(declared)}"
            raise PermissionDeniedError(
                f"this Join declares pid {request.pid}, which {runs_as}, but it comes from {caller}: a Join "
                "declares its own process",
                **where,
            )
        return caller.uid

    def operates(self, caller: Caller) -> bool:
        """Whether `caller` is one of the daemon's operators (sees every group)."""
        return caller.uid is not None and self.admission.operates(caller.uid)


def rank_secret(context: grpc.aio.ServicerContext) -> bytes:
    """The caller's rank secret (JoinReply.rank_secret), from the call's metadata; b"" if none."""
    for key, value in context.invocation_metadata() or ():
        if key == RANK_SECRET_KEY and isinstance(value, bytes):
            return value
    return b""
