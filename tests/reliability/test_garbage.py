"""Garbage on the daemon's sockets: random bytes, truncated and oversized HTTP/2 on the gRPC socket;
random bytes, short and long tokens and unexpected descriptors on the descriptor socket;
connections opened and dropped, many at once. After each, the daemon must still serve, hold no
descriptor it did not hold before, and a real group must still form and all-reduce.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from contextlib import ExitStack, closing
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import nodecomm
import ranks
from conftest import join_request
from nodecomm.service.memory import handles
from nodecomm.v1 import control_pb2 as pb
from waiting import wait_until

from .harness import FIGURES, Checked, SessionStream, fd_count, fuzz

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
TOKEN_BYTES = 16
EXPIRED_CLAIMS = 'nodecomm_descriptor_claims_total{result="expired"}'
# 16-byte requests the descriptor socket answers other than as claim tokens (hypothesis tries the
# constants it finds in the code it runs, so it sends these too).
SPECIAL_REQUESTS = {value for name in ("IDENTIFY",) if isinstance(value := getattr(handles, name, None), bytes)}


def frame(kind: int, flags: int, stream: int, payload: bytes, length: int | None = None) -> bytes:
    """One HTTP/2 frame; `length` may lie about the payload's size."""
    size = len(payload) if length is None else length
    return struct.pack(">I", size)[1:] + bytes([kind & 0xFF, flags & 0xFF]) + struct.pack(">I", stream) + payload


SETTINGS = frame(4, 0, 0, b"")


def grpc_connection(daemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(2.0)
    sock.connect(daemon.socket)
    return sock


def descriptor_connection(daemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(daemon.descriptor_socket)
    return sock


def send_and_drain(sock: socket.socket, data: bytes, *, half_close: bool, wait: float = 0.2) -> bytes:
    """Send `data` (the daemon may hang up part-way), maybe half-close, read what comes back."""
    received = b""
    try:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        sock.settimeout(wait)
        while chunk := sock.recv(65536):
            received += chunk
    except (TimeoutError, OSError):
        pass  # the daemon hung up, or said nothing more in time: both are fine
    return received


def works(daemon) -> None:
    """A real CPU group forms on the daemon and all-reduces (world size 1, in this process)."""
    with nodecomm.connect("garbage-check", 0, 1, socket=daemon.socket, timeout=10) as comm:
        assert comm.all_reduce(torch.arange(8, dtype=torch.float32)).tolist() == list(range(8))


def still_serving(daemon, checked: Checked) -> None:
    checked.assert_alive()
    works(daemon)


@pytest.fixture(scope="module")
def baseline(fuzz_daemon, checked) -> int:
    """The daemon's descriptor count once it has served one group and this module's channel."""
    works(fuzz_daemon)
    checked.call("ListGroups", pb.ListGroupsRequest())
    pid = fuzz_daemon.process.pid
    wait_until(lambda: not checked.stub.ListGroups(pb.ListGroupsRequest(), timeout=5).groups, 10, "groups released")
    return fd_count(pid)


def assert_back_to_baseline(daemon, checked: Checked, baseline: int, timeout: float = 10.0) -> None:
    checked.assert_alive()
    pid = daemon.process.pid
    try:
        wait_until(lambda: fd_count(pid) <= baseline, timeout, "the daemon's descriptors back to baseline")
    except AssertionError:
        held = sorted(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
        raise AssertionError(f"{len(held)} descriptors open, {baseline} before: {held}") from None
    works(daemon)


# -- the gRPC socket -----------------------------------------------------------------------------------

GRPC_PREFIXES = st.sampled_from([b"", PREFACE, PREFACE[:1], PREFACE[:12], PREFACE[:-1], PREFACE + SETTINGS])


@fuzz(150)
@given(prefix=GRPC_PREFIXES, body=st.binary(max_size=2048), half_close=st.booleans())
def test_random_bytes_on_the_grpc_socket(fuzz_daemon, checked, baseline, prefix, body, half_close):
    with closing(grpc_connection(fuzz_daemon)) as sock:
        send_and_drain(sock, prefix + body, half_close=half_close, wait=0.05)
    FIGURES.garbage()
    still_serving(fuzz_daemon, checked)


@st.composite
def http2_frames(draw) -> bytes:
    """A frame of any type, flags and stream, whose declared length may lie (up to 16 MiB - 1)."""
    payload = draw(st.binary(max_size=256))
    length = draw(st.one_of(st.none(), st.sampled_from([0, 9, 16384, 16385, 2**24 - 1]), st.integers(0, 2**24 - 1)))
    kind = draw(st.one_of(st.integers(0, 9), st.integers(0, 255)))
    return frame(
        kind, draw(st.integers(0, 255)), draw(st.sampled_from([0, 1, 3, 2**31 - 1, 2**32 - 1])), payload, length
    )


@fuzz(150)
@given(frames=st.lists(http2_frames(), min_size=1, max_size=6), settings_first=st.booleans())
def test_malformed_http2_frames(fuzz_daemon, checked, baseline, frames, settings_first):
    with closing(grpc_connection(fuzz_daemon)) as sock:
        data = PREFACE + (SETTINGS if settings_first else b"") + b"".join(frames)
        send_and_drain(sock, data, half_close=False, wait=0.05)
    FIGURES.garbage()
    still_serving(fuzz_daemon, checked)


@pytest.mark.parametrize("kind", [0, 1, 4, 9])  # DATA, HEADERS, SETTINGS, CONTINUATION
def test_a_huge_frame(fuzz_daemon, checked, baseline, kind):
    """A 16 MiB frame after the preface: past every frame-size limit, sent in full."""
    payload = os.urandom(1 << 20) * 16
    with closing(grpc_connection(fuzz_daemon)) as sock:
        send_and_drain(sock, PREFACE + SETTINGS + frame(kind, 0, 1, payload[: (1 << 24) - 1]), half_close=True)
    FIGURES.garbage()
    assert_back_to_baseline(fuzz_daemon, checked, baseline)


# -- the descriptor socket -----------------------------------------------------------------------------


@dataclass
class Owner:
    ids: dict  # a group this process joined: its tokens are claimed here
    stranger: dict  # a group joined declaring pid 1: its tokens are refused here (wrong peer)
    fds: int  # the daemon's descriptor count with both formed (their segments) and idle


@pytest.fixture(scope="module")
def owner(fuzz_daemon, checked, baseline) -> Owner:
    """Formed world-1 groups, their sessions open: they hand out real tokens."""
    groups, sessions = {}, []
    expired = fuzz_daemon.metric(EXPIRED_CLAIMS)
    for name, pid in (("garbage-owner", None), ("garbage-stranger", 1)):
        reply = checked.stub.Join(join_request(name, 0, 1, capacity=4096, pid=pid), timeout=5)
        sessions.append(SessionStream(checked.stub, reply.group_id, 0))
        sessions[-1].wait_ready()
        groups[name] = dict(group=name, group_id=reply.group_id, rank=0)
    # The joins' unclaimed tokens expire (ttl 2 s): the daemon's sweep closes their duplicates,
    # then counts them.
    wait_until(
        lambda: fuzz_daemon.metric(EXPIRED_CLAIMS) >= expired + len(groups),
        30,
        lambda: (
            f"the joins' {len(groups)} claim tokens expired (expired claims {expired} before, "
            f"{fuzz_daemon.metric(EXPIRED_CLAIMS)} now)"
        ),
    )
    yield Owner(groups["garbage-owner"], groups["garbage-stranger"], fd_count(fuzz_daemon.process.pid))
    for ids in groups.values():
        checked.stub.Leave(pb.LeaveRequest(**ids), timeout=5)
    for session in sessions:
        session.close()


def fresh_token(checked: Checked, ids: dict) -> tuple[bytes, int]:
    """A real claim token for one new allocation (freed at once: the claim keeps its descriptor)."""
    reply = checked.stub.AllocateMemory(pb.AllocateMemoryRequest(**ids, size_bytes=4096), timeout=5)
    checked.stub.FreeMemory(pb.FreeMemoryRequest(**ids, allocation_id=reply.allocation_id), timeout=5)
    return reply.claim_token, reply.allocation_id


def stray_descriptors(count: int) -> list[int]:
    """Descriptors of several kinds for a client to attach where none is expected."""
    made = []
    for index in range(count):
        kind = index % 3
        if kind == 0:
            made.append(os.open(os.devnull, os.O_RDONLY))
        elif kind == 1:
            read, write = os.pipe()
            os.close(write)
            made.append(read)
        else:
            made.append(os.memfd_create("garbage-stray"))
    return made


def answer(sock: socket.socket) -> tuple[bytes, list[int]]:
    """The daemon's status byte and reason (or nothing), and any descriptors it sent."""
    try:
        message, fds, _, _ = socket.recv_fds(sock, 4096, 8)
    except (TimeoutError, OSError):
        return b"", []
    return message, list(fds)


@fuzz(200)
@given(
    shape=st.sampled_from(["random", "short", "token+extra", "unknown+fds", "token+fds", "nothing", "stranger"]),
    payload=st.binary(max_size=64),
    extra=st.binary(min_size=1, max_size=256),
    fd_count_=st.integers(1, 6),
)
def test_garbage_on_the_descriptor_socket(fuzz_daemon, checked, owner, shape, payload, extra, fd_count_):
    stray = stray_descriptors(fd_count_) if shape.endswith("+fds") else []
    token = stranger = None
    if shape.startswith("token"):
        token, _ = fresh_token(checked, owner.ids)
    elif shape == "stranger":
        stranger, _ = fresh_token(checked, owner.stranger)
    with ExitStack() as stack:
        for fd in stray:
            stack.callback(os.close, fd)
        sock = stack.enter_context(closing(descriptor_connection(fuzz_daemon)))
        sent = {
            "random": payload,
            "short": payload[: TOKEN_BYTES - 1],
            "token+extra": (token or b"") + extra,
            "unknown+fds": (payload + bytes(TOKEN_BYTES))[:TOKEN_BYTES] + extra,
            "token+fds": token or b"",
            "nothing": b"",
            "stranger": stranger or b"",
        }[shape]
        try:
            if stray:
                socket.send_fds(sock, [sent], stray)
            else:
                sock.sendall(sent)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the daemon answered and hung up before all was sent
        message, received = answer(sock)
        for fd in received:
            os.close(fd)
    FIGURES.garbage()
    if token is not None:  # a real token claims its one descriptor, whatever came with it
        assert message[:1] == b"\x00" and len(received) == 1, (message, received)
    elif stranger is not None:  # issued to pid 1: refused to this process, and used up
        assert message[:1] == b"\x01" and b"was issued to pid 1" in message and not received, message
    elif sent[:TOKEN_BYTES] in SPECIAL_REQUESTS:  # not a claim: an answer, never a descriptor
        assert message[:1] in (b"\x00", b"\x01") and not received, (message, received)
    else:  # fewer than 16 bytes are malformed, the first 16 of more an unknown token
        assert message[:1] == b"\x01" and message[1:].decode() and not received, (message, received)
    still_serving(fuzz_daemon, checked)


def test_stray_descriptors_do_not_stay_in_the_daemon(fuzz_daemon, checked, owner):
    """What the last test attached was closed by the daemon (or never reached it), and every
    claimed token's duplicates are closed."""
    assert_back_to_baseline(fuzz_daemon, checked, owner.fds)


# -- many at once --------------------------------------------------------------------------------------


def test_many_connections_opened_and_dropped_at_once(fuzz_daemon, checked, owner):
    """Hundreds of connections on both sockets, held open (silent, half a preface, half a token)
    while the daemon must go on serving, then dropped all together. 200 on the descriptor socket:
    past its per-uid share of waiting connections (256) it would close this uid's oldest."""
    held: list[socket.socket] = []
    try:
        for index in range(200):
            for connect, partial in ((grpc_connection, PREFACE[:10]), (descriptor_connection, b"\x01" * 7)):
                sock = connect(fuzz_daemon)
                held.append(sock)
                if index % 3 == 1:
                    sock.sendall(partial)
                elif index % 3 == 2:
                    sock.sendall(partial * 3)
        FIGURES.garbage(len(held))
        still_serving(fuzz_daemon, checked)
        # A claim that never completes is dropped after the daemon's 2 s I/O timeout (one of 21
        # bytes was answered at once: its first 16 are an unknown token): each connection is read
        # to its end, which a daemon that kept the connection never gives.
        deadline = time.monotonic() + 30
        for index, sock in enumerate(held[1::2]):
            reply = b""
            try:
                while True:
                    sock.settimeout(max(deadline - time.monotonic(), 0.01))
                    if not (chunk := sock.recv(4096)):
                        break
                    reply += chunk
            except ConnectionResetError:
                assert index % 3 == 2  # closed with the token's 5 extra bytes unread
            except TimeoutError:
                raise AssertionError(
                    f"the daemon closed descriptor connection {index} ({(0, 7, 21)[index % 3]} bytes of a "
                    "token sent): not within 30 s"
                ) from None
            assert reply[:1] in ((b"\x01", b"") if index % 3 == 2 else (b"",)), (index, reply)
    finally:
        for sock in held:
            sock.close()

    # Opened and closed at once, from many threads, without a byte.
    def churn() -> None:
        for _ in range(50):
            with closing(descriptor_connection(fuzz_daemon)), closing(grpc_connection(fuzz_daemon)):
                pass

    threads = [threading.Thread(target=churn) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    FIGURES.garbage(8 * 50 * 2)
    assert_back_to_baseline(fuzz_daemon, checked, owner.fds, timeout=15)


def test_a_group_of_rank_processes_forms_after_the_garbage(fuzz_daemon, checked, spawn_ranks):
    results = spawn_ranks(ranks.join_only, 2, 2, fuzz_daemon.socket, "after-garbage", {}, timeout=120).values()
    assert results == {0: "ok [2.0, 2.0, 2.0, 2.0]", 1: "ok [2.0, 2.0, 2.0, 2.0]"}
    checked.assert_alive()
