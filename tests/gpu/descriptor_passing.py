"""Hand VMM descriptors from the allocating process to rank processes, as the daemon's descriptor
socket does, with plain Unix sockets the GPU tests set up themselves."""

import os
import socket

from nodecomm import _native


def receive_and_map(path: str, count: int, size: int, device: int, ready) -> list[int]:
    """Listen on `path`, say "listening" on `ready`, take `count` descriptors, map each on `device`."""
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        server.listen(1)
        ready.put("listening")
        conn, _ = server.accept()
        with conn:
            _, fds, _, _ = socket.recv_fds(conn, 16, count)
    addresses = [_native.cuda_vmm_import(device, fd, size) for fd in fds]
    for fd in fds:
        os.close(fd)
    return addresses


def send(path: str, fds: list[int]) -> None:
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(path)
        socket.send_fds(conn, [b"x"], fds)
