"""What each daemon setting must be (service/config.py declares each setting with its check): a
check raises ValueError naming the setting and what it expected."""

from __future__ import annotations

import grp
import ipaddress
import os
import pwd
from collections.abc import Callable
from typing import Any

Check = Callable[[str, Any], None]


def at_least_one(name: str, value: Any) -> None:
    if value < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")


def seconds(name: str, value: Any) -> None:
    if not value > 0:
        raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")


def byte_limit(name: str, value: Any) -> None:
    if not isinstance(value, int) or value < 64:
        raise ValueError(f"{name}: expected a byte size of at least 64, got {value!r}")


def one_of(*choices: str) -> Check:
    shown = [repr(choice) for choice in choices]
    expected = f"{', '.join(shown[:-1])} or {shown[-1]}" if len(shown) > 1 else shown[0]

    def check(name: str, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"{name}: expected {expected}, got {value!r}")

    return check


def ids(name: str, value: Any) -> None:
    parse_ids(name, value)


def pem_file(name: str, value: Any) -> None:
    if value and not os.path.isfile(value):
        raise ValueError(f"{name} {value!r}: no such file")


def address_or_off(name: str, value: Any) -> None:
    if value != "off":
        split_address(name, value)


def fraction(name: str, value: Any) -> None:
    if not 0 <= value < 1:
        raise ValueError(f"{name}: expected a fraction in [0, 1), got {value!r}")


def period_or_off(name: str, value: Any) -> None:
    if value < 0:
        raise ValueError(f"{name}: expected 0 (off) or a positive integer, got {value!r}")


def level_name(name: str, value: Any) -> None:
    if value.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"{name} {value!r}: expected DEBUG, INFO, WARNING, ERROR or CRITICAL")


def parse_ids(field: str, text: str) -> frozenset[int]:
    """Comma-separated numeric ids or names: uids for allowed_uids and operator_uids, gids otherwise."""
    found = set()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item.isdigit():
            found.add(int(item))
            continue
        try:
            found.add(pwd.getpwnam(item).pw_uid if field.endswith("_uids") else grp.getgrnam(item).gr_gid)
        except KeyError:
            kind = "user" if field.endswith("_uids") else "group"
            raise ValueError(f"{field}: no {kind} named {item!r}; expected ids or names, comma-separated") from None
    return frozenset(found)


def check_directory(name: str, path: str) -> None:
    """`path` is a directory, or one can be made there (what exists of it is a directory). Whether
    this uid may write there is the daemon's to find when it saves (a read-only state_dir of
    calibrations put there by hand is one way to deploy)."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = (
            "is not a directory"
            if existing == os.path.abspath(path)
            else f"is under {existing}, which is not a directory"
        )
        raise ValueError(f"{name} {path!r}: {what}; expected a directory (or one that can be made)")


def split_address(field: str, address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise ValueError(f"{field} {address!r}: expected 'ip:port', e.g. '127.0.0.1:9464'") from None
    if not sep or not 0 <= number <= 65535:
        raise ValueError(f"{field} {address!r}: expected 'ip:port' with a port in 0..65535")
    return host, number
