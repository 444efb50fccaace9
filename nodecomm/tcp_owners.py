"""Who owns a loopback TCP socket, as /proc/net/tcp and /proc/net/tcp6 say: the daemon names a TCP
caller by the owner of the connection's other end, and a rank checks who listens where it would
connect before it trusts a daemon there without TLS.

An IPv4 connection may end at an IPv6 socket (gRPC's are, and a wildcard IPv6 listener takes IPv4
connections): there it is in tcp6, its addresses IPv4-mapped.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Iterator

_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
LISTEN = "0A"  # the kernel's TCP_LISTEN, as the tables write a socket's state


def proc_address(host: str, port: int, mapped: bool = False) -> str:
    """An address as /proc/net/tcp{,6} writes it: the IP's bytes (IPv4-mapped IPv6 if `mapped`)
    as native-endian 32-bit words in hex, a colon, the port in hex."""
    ip = ipaddress.ip_address(host)
    if mapped and ip.version == 4:
        ip = ipaddress.IPv6Address(f"::ffff:{ip}")
    packed = ip.packed
    words = [struct.unpack("=I", packed[i : i + 4])[0] for i in range(0, len(packed), 4)]
    return "".join(f"{word:08X}" for word in words) + f":{port:04X}"


def _rows() -> Iterator[tuple[str, str, str, int]]:
    """(local address, remote address, state, uid) of every TCP socket the tables list."""
    for table in _TABLES:
        try:
            with open(table) as rows:
                next(rows)
                for row in rows:
                    fields = row.split()
                    yield fields[1], fields[2], fields[3], int(fields[7])
        except OSError:
            continue


def peer_uid(local: tuple, peer: tuple) -> int | None:
    """The uid that owns the socket at the other end of a loopback TCP connection (this end at
    `local`, the other at `peer`, each (host, port, ...)); None off loopback or unknown."""
    if not ipaddress.ip_address(peer[0]).is_loopback:
        return None
    wanted = {
        (proc_address(peer[0], peer[1], mapped), proc_address(local[0], local[1], mapped)) for mapped in (False, True)
    }
    return next((uid for here, there, _, uid in _rows() if (here, there) in wanted), None)


def owners_at(host: str, port: int) -> tuple[set[int], bool]:
    """Who owns the sockets where a connection to the loopback `host`:`port` could land (that
    address, and its family's wildcard, an IPv6 one also for IPv4), listening or accepted, and
    whether one of them listens."""
    ip = ipaddress.ip_address(host)
    addresses = {proc_address(host, port)}
    if ip.version == 4:
        addresses |= {proc_address("0.0.0.0", port), proc_address(host, port, mapped=True), proc_address("::", port)}
    else:
        addresses.add(proc_address("::", port))
    owners, listening = set(), False
    for here, _, state, uid in _rows():
        if here in addresses:
            owners.add(uid)
            listening |= state == LISTEN
    return owners, listening
