"""A rank's tie to the daemon serving its group: the channel its calls use, its lease on a job's
private daemon, and the group's hand-over to the next daemon on the socket when this one goes
(service/groups/adoption.py). The group's peer paths never need it; the control plane does."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import grpc

from nodecomm.daemon_channel import open_channel
from nodecomm.errors import DaemonUnavailableError, from_rpc_error
from nodecomm.thresholds import DispatchTable, Path
from nodecomm.v1 import control_pb2 as pb
from nodecomm.v1 import control_pb2_grpc as pb_grpc

from .daemon_choice import DaemonChoice, DaemonMode, JobLeaseHandle, attach_private
from .descriptors import DescriptorSocket
from .membership import Membership

log = logging.getLogger("nodecomm.client")

_PRIVATE_START_SECONDS = 10.0  # the most a rank waits for the job's next private daemon to serve


class DaemonLink:
    """The channel and stub of the daemon serving the group now, and what hands the group on:
    a descriptor of the control page (owned here) and the ticket the daemon that formed it gave."""

    def __init__(
        self,
        channel: grpc.Channel,
        membership: Membership,
        metadata: tuple,
        descriptor_socket: DescriptorSocket,
        daemon: DaemonChoice | None,
        lease: JobLeaseHandle | None,
        control_fd: int,
        ticket: pb.AdoptionTicket | None,
    ):
        self.channel = channel
        self.stub = pb_grpc.ControlStub(channel)
        self.daemon = daemon
        self.ticket = ticket
        self._membership = membership
        self._metadata = metadata
        self._descriptor_socket = descriptor_socket
        self._lease = lease
        self._control_fd = control_fd
        self._retired: list[grpc.Channel] = []  # those of daemons the group was handed on from
        # Held to hand the channel on and to close it; never across a call: a collective in flight
        # (up to the operation timeout) must not keep the next daemon's session from opening
        # within its grace, or the next daemon aborts the group.
        self._swap = threading.Lock()
        self._closed = False

    @property
    def adoptable(self) -> bool:
        """Whether a later daemon can take the group over (a control page and a ticket to hand it)."""
        return self._control_fd >= 0 and self.ticket is not None and bool(self.ticket.tag) and self.daemon is not None

    @staticmethod
    def needs_daemon(transport, table: DispatchTable) -> str | None:
        """Why a group cannot run on once its daemon is gone (None: it can). Every rank answers
        alike where the ranks hold one table; one that aborts aborts them all."""
        if not transport.memory_outlives_daemon:
            return "its buffers are legacy CUDA IPC memory, which the daemon's exit frees"
        if Path.SERVICE in table.range_paths:
            # A rank that learned of the loss later would send a call the daemon ran to its peers.
            return "its table sends sizes to the service path, which the daemon runs"
        return None

    def reattach(
        self,
        table: Callable[[], DispatchTable],
        calls_without_daemon: int,
        closed: Callable[[], bool],
        use: Callable[[pb_grpc.ControlStub], None],
    ) -> pb_grpc.ControlStub:
        """Hand the group to the daemon serving the socket now: it must prove who it is as at
        connect() (nodecomm.daemon_channel), then takes the control page, the ticket and the table in force
        (`table()`, read as the request is made). Unless `closed()` or this link is closed, its stub
        replaces the old one and `use(stub)` is called, whatever collective runs meanwhile (a call
        may still hold the old stub); returns the stub. Raises DaemonUnavailableError while nothing
        serves."""
        where = self._membership.where
        lease = None
        if self.daemon.kind is DaemonMode.PRIVATE:
            # The job's own daemon: one of its ranks starts the next (under the job directory's
            # lock, so one does), and each takes a lease on it as at connect(). A daemon that does
            # not serve in time is killed: long enough for a loaded node (0.3 s on an idle one),
            # or every try would kill the one the try before started.
            _, lease = attach_private(self.daemon.socket, _PRIVATE_START_SECONDS, where)
        try:
            # Short waits: close() waits for the session thread that runs this.
            channel, _ = open_channel(self.daemon.socket, self.daemon.daemon_uids, 1.0, [("grpc.enable_retries", 0)])
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        try:
            token = self._descriptor_socket.hand_back(self._control_fd, 1.0, where)
            stub = pb_grpc.ControlStub(channel)
            request = pb.AdoptRequest(
                ticket=self.ticket, rank=self._membership.rank, control_token=token,
                thresholds=table().to_proto(), calls_without_daemon=calls_without_daemon,
            )  # fmt: skip
            reply = stub.Adopt(request, timeout=3.0, metadata=self._metadata)
        except BaseException as error:
            channel.close()
            if lease is not None:
                lease.release()
            if isinstance(error, grpc.RpcError):
                raise from_rpc_error(error, **where) from None
            raise
        log.info(
            "group handed to the daemon serving now",
            extra={**where, "adopted_here": reply.adopted, "calls_without_daemon": calls_without_daemon},
        )
        with self._swap:
            if closed() or self._closed:  # close() ran meanwhile: this channel is nobody's
                channel.close()
                if lease is not None:
                    lease.release()
                raise DaemonUnavailableError("the communicator was closed", **where)
            # The old channel is closed with the communicator: a call may still hold its stub.
            self._retired.append(self.channel)
            self.channel, self.stub = channel, stub
            use(stub)
            if lease is not None:
                if self._lease is not None:
                    self._lease.release()
                self._lease = lease
        return stub

    def leave(self) -> None:
        """Tell the daemon this rank leaves its group (a daemon that does not answer is logged)."""
        membership = self._membership
        try:
            self.stub.Leave(
                pb.LeaveRequest(group=membership.group, group_id=membership.group_id, rank=membership.rank),
                timeout=5.0,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            log.info("leave failed", extra={**membership.where, "error": str(from_rpc_error(error))})

    def close(self) -> None:
        with self._swap:
            self._closed = True
        if self._control_fd >= 0:
            os.close(self._control_fd)
        for channel in (*self._retired, self.channel):
            channel.close()
        if self._lease is not None:
            self._lease.release()  # the job's private daemon may leave once every rank has
