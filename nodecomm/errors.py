"""The one exception hierarchy of nodecomm, and its one mapping to gRPC status codes.

The daemon raises these; its servicer turns them into a status with `status_code_for`; the client
turns a status back into the same class with `from_rpc_error`. The native module raises the same
classes (it looks them up here), so a caller catches one hierarchy whatever failed.
"""

from __future__ import annotations

import re

import grpc


class NodecommError(RuntimeError):
    """Base of every nodecomm error. `group` and `rank` say whose operation failed, when known.
    A RuntimeError, as torch.distributed's backends' errors are, so that a caller that catches
    those catches these."""

    def __init__(self, message: str, *, group: str | None = None, rank: int | None = None):
        self.group = group
        self.rank = rank
        where = []
        if group is not None:
            where.append(f"group {shown(group)}")
        if rank is not None:
            where.append(f"rank {rank}")
        prefix = f"[{', '.join(where)}] " if where else ""
        super().__init__(prefix + message if message and not message.startswith(prefix) else message)
        self.detail = message

    def located(self, *, group: str | None = None, rank: int | None = None) -> NodecommError:
        """The same error, said of `group` and `rank`."""
        return type(self)(self.detail, group=group, rank=rank)


class InvalidArgumentError(NodecommError, ValueError):
    """A request or a call was malformed: the message names the field and what was expected."""


class GroupMismatchError(NodecommError):
    """The ranks of a group disagree on world size or geometry; raised on every rank."""


class AlreadyExistsError(NodecommError):
    """The rank is already taken in a group that is forming or formed under that name."""


class NotFoundError(NodecommError):
    """The named group (or rank within it) does not exist on this daemon."""


class DeadlineExceededError(NodecommError, TimeoutError):
    """A wait ran out of time: a join whose peers never came, or a collective whose peer stalled."""


class PeerLostError(NodecommError):
    """A peer rank's session ended (it died or left) while the group was in use; the group is aborted."""


class DaemonUnavailableError(NodecommError, ConnectionError):
    """The daemon cannot be reached, restarted under this rank, or is shutting down."""


class NoDaemonError(DaemonUnavailableError):
    """Nothing serves at the daemon's socket: its file is absent or refuses connections."""


class ResourceExhaustedError(NodecommError):
    """An allocation or a quota failed; nothing was kept."""


class PermissionDeniedError(NodecommError):
    """The caller's credentials do not match what the request claims."""


class UnsupportedError(NodecommError):
    """What was asked cannot run on this machine (e.g. GPUs that cannot reach each other's memory)."""


class InternalError(NodecommError):
    """A bug or an unexpected system failure; the message carries the cause."""


# The most bytes of UTF-8 a status message may have: it travels in an HTTP/2 trailer, and a client
# drops a trailer past a few KiB (the rank then sees a transport error instead of the daemon's).
MAX_STATUS_DETAIL_BYTES = 1024


def shown(value: object, limit: int = 80) -> str:
    """A value from a request, as an error message quotes it: ASCII (ascii()), at most about `limit`
    characters. Requests may carry strings and lists of any length."""
    text = ascii(value)
    if len(text) <= limit:
        return text
    if not isinstance(value, (str, bytes, list, tuple)):
        return text[:limit] + "..."
    return text[:limit] + f"... ({len(value)} {'items' if isinstance(value, (list, tuple)) else 'characters'})"


def status_details(error: NodecommError) -> str:
    """The status message for `error`: its text, cut in the middle past MAX_STATUS_DETAIL_BYTES."""
    text = str(error)
    encoded = text.encode()
    if len(encoded) <= MAX_STATUS_DETAIL_BYTES:
        return text
    head = encoded[: MAX_STATUS_DETAIL_BYTES * 2 // 3].decode(errors="ignore")
    tail = encoded[-(MAX_STATUS_DETAIL_BYTES // 4) :].decode(errors="ignore")
    return f"{head} [... {len(text) - len(head) - len(tail)} characters cut ...] {tail}"


_STATUS_BY_CLASS: dict[type[NodecommError], grpc.StatusCode] = {
    InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    GroupMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    AlreadyExistsError: grpc.StatusCode.ALREADY_EXISTS,
    NotFoundError: grpc.StatusCode.NOT_FOUND,
    DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    PeerLostError: grpc.StatusCode.ABORTED,
    DaemonUnavailableError: grpc.StatusCode.UNAVAILABLE,
    ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    UnsupportedError: grpc.StatusCode.UNIMPLEMENTED,
    InternalError: grpc.StatusCode.INTERNAL,
}
_CLASS_BY_STATUS = {code: cls for cls, code in _STATUS_BY_CLASS.items()}
# Statuses gRPC itself produces without a daemon-side error behind them.
_CLASS_BY_STATUS[grpc.StatusCode.CANCELLED] = DaemonUnavailableError
_CLASS_BY_STATUS[grpc.StatusCode.UNKNOWN] = InternalError


def status_code_for(error: NodecommError) -> grpc.StatusCode:
    """The gRPC status code the daemon answers with for `error`."""
    for cls in type(error).__mro__:
        if cls in _STATUS_BY_CLASS:
            return _STATUS_BY_CLASS[cls]
    return grpc.StatusCode.INTERNAL


# The location a NodecommError's message starts with: "[group 'g', rank 3] ", "[group 'g'] ", "[rank 3] ".
_LOCATION = re.compile(r"\[(group '[^']*'(, rank -?\d+)?|rank -?\d+)\] ")


def from_rpc_error(error: grpc.RpcError, *, group: str | None = None, rank: int | None = None) -> NodecommError:
    """The nodecomm error for a failed RPC, keeping the daemon's message (its location gives way to
    the caller's, which names the rank too)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    if group is not None or rank is not None:
        location = _LOCATION.match(details)
        details = details[location.end() :] if location else details
    cls = _CLASS_BY_STATUS.get(code, InternalError)
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"daemon unavailable: {details}"
    return cls(details, group=group, rank=rank)
