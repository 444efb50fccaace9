"""How a process proves who it is to the daemon; the daemon and the client both use these.

IDENTIFY: sent on the descriptor socket instead of a claim token, it asks for a one-time identity
(the daemon reads the caller's pid, uid and groups with SO_PEERCRED) that a Join then carries.
HANDBACK: sent on the descriptor socket, then (once the daemon answers 0) one byte with the rank's
control page attached (SCM_RIGHTS): the daemon answers 0 and a 16-byte token that an Adopt carries.
RANK_SECRET_KEY: the gRPC metadata key of the secret a JoinReply gives each rank, which every
later per-rank call carries, so that no other process can act as that rank.
"""

IDENTIFY = b"nodecomm:whoami\x00"  # 16 bytes, like a claim token (which equals it with odds 2^-128)
HANDBACK = b"nodecomm:handbk\x00"  # a rank hands its group's control page back, for Adopt
RANK_SECRET_KEY = "nodecomm-rank-secret-bin"


def rank_metadata(secret: bytes) -> tuple[tuple[str, bytes], ...]:
    """The metadata of a per-rank call."""
    return ((RANK_SECRET_KEY, secret),)
