"""What a process of another uid gets from a daemon's descriptor socket.

Run by `conftest.as_user` as `python as_user.py UID GID QUESTION PATH`, as root: the process
imports what it needs, drops to UID/GID with no supplementary groups, asks QUESTION of the socket
at PATH and writes the answer to stdout. A fresh process rather than a fork of the test's, which
has gRPC's and torch's threads: a fork there can stop for good in a handler of theirs.

Questions:
  identify  send IDENTIFY, write the raw answer (b"\\x02": none; b"\\x03" + the error: no connection)
  connect   what nodecomm.connect's first step (identify) raises: "no error" or "Class message"
  health    a health check on the control socket at PATH: "SERVING", or the gRPC status and details
  serve     remove what is at PATH and bind a socket there: "bound", or the error
"""

from __future__ import annotations

import os
import socket
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nodecomm.client.descriptors import DescriptorSocket
from nodecomm.credentials import IDENTIFY
from nodecomm.errors import NodecommError
from nodecomm.trust import node_daemon_uids


def raw_identify(path: str) -> bytes:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(path)
            sock.sendall(IDENTIFY)
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
        return answer or b"\x02"
    except OSError as error:
        return b"\x03" + str(error).encode()


def connect_identify(path: str) -> bytes:
    try:
        DescriptorSocket(path, node_daemon_uids(path)).identify(5.0, {})
        return b"no error"
    except NodecommError as error:
        return f"{type(error).__name__} {error}".encode()


def health(path: str) -> bytes:
    try:
        with grpc.insecure_channel(f"unix:{path}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status).encode()
    except grpc.RpcError as error:
        return f"{error.code().name} {error.details()}".encode()


def serve(path: str) -> bytes:
    """Take the daemon's socket path over (remove what is there, bind a socket of this uid's)."""
    try:
        if os.path.lexists(path):
            os.unlink(path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind(path)
        return b"bound"
    except OSError as error:
        return f"{type(error).__name__}: {error}".encode()


QUESTIONS = {"identify": raw_identify, "connect": connect_identify, "health": health, "serve": serve}

if __name__ == "__main__":
    uid, gid, question, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    sys.stdout.buffer.write(QUESTIONS[question](path))
