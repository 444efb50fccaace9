"""Who calls the daemon, for the limits every caller gets a share of and for the names it sees.

A caller is a uid, proven by an identity the descriptor socket issued after reading the process's
SO_PEERCRED (every Join over the Unix socket carries one), or, over TCP, the one caller that all
TCP clients without an identity are together. Group names live in their caller's namespace: two
uids may both have a group "tp0", and neither sees, joins or squats the other's (unless the daemon
allows groups of mixed uids, which share one namespace).
"""

from __future__ import annotations

import pwd
from dataclasses import dataclass


@dataclass(frozen=True)
class Caller:
    """A uid, or (uid None) the TCP clients that presented no identity."""

    uid: int | None

    def __str__(self) -> str:
        if self.uid is None:
            return "TCP callers without an identity"
        try:
            return f"uid {self.uid} ({pwd.getpwuid(self.uid).pw_name})"
        except KeyError:
            return f"uid {self.uid}"


TCP_CALLER = Caller(None)


@dataclass(frozen=True)
class Peer:
    """The process at the other end of a call's connection, as the gate read it when it arrived:
    its caller, its transport ("unix" or "tcp"), and its pid where SO_PEERCRED gives one (Unix)."""

    caller: Caller
    transport: str
    pid: int | None = None
