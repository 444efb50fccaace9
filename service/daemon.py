"""nodecommd, the process: the gRPC control plane over the GroupRegistry, the descriptor socket,
/metrics, and a graceful stop on SIGTERM/SIGINT (health NOT_SERVING, refuse joins, end the sessions,
exit 0), leaving running groups to their ranks, or with drain_on_stop a drain (abort every group
first). `python -m nodecomm.service` runs it."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from nodecomm import _native, trust
from nodecomm.capabilities import DeviceKind
from nodecomm.errors import NodecommError
from nodecomm.service.access.connections import Gate, GateInterceptor
from nodecomm.service.access.identity import Identity
from nodecomm.service.access.listening import (
    internal_socket,
    listen_unix,
    prepare_socket_path,
    remove_internal_directories,
    restrict_socket_file,
    tls_credentials,
)
from nodecomm.service.calibration.stored import CalibrationStore
from nodecomm.service.config import DaemonConfig, load_config
from nodecomm.service.config_checks import parse_ids
from nodecomm.service.groups.adoption import load_key
from nodecomm.service.groups.registry import GroupRegistry
from nodecomm.service.job_lease import JobLease
from nodecomm.service.logs import RateLimitedLog, configure_logging
from nodecomm.service.memory.allocator import raise_descriptor_limit
from nodecomm.service.memory.handles import Admission, ClaimTable, DescriptorServer, HandbackTable, IdentityTable
from nodecomm.service.metrics.endpoint import MetricsEndpoint
from nodecomm.service.metrics.families import DaemonMetrics
from nodecomm.service.server import MAX_MESSAGE_BYTES, SERVICE_NAME, ControlServicer, add_control_servicer
from nodecomm.v1 import control_pb2 as pb

log = logging.getLogger("nodecomm.server")
# How often the daemon looks for groups whose ranks aborted them (GroupRegistry.notice_aborts).
ABORT_NOTICE_SECONDS = 0.5


async def _calibrate_on_start(
    registry: GroupRegistry, config: DaemonConfig, store: CalibrationStore, kinds: list[str]
) -> None:
    """No calibration for this machine's fingerprint: probe now, while serving, kind by kind."""
    for kind in kinds:
        log.info("calibrating on start: no stored calibration for this machine", extra={"device_kind": kind})
        try:
            await registry.tables.calibrate(pb.CalibrateRequest(device_kind=kind), config.socket, store)
        except NodecommError as error:
            log.warning(
                "calibration on start failed; built-in defaults stay", extra={"device_kind": kind, "error": str(error)}
            )


async def serve(config: DaemonConfig) -> int:
    # Every group, allocation and connection costs descriptors: take all the system allows.
    descriptor_limit = raise_descriptor_limit()
    # gRPC listens where only this uid can connect: every client comes through the gate. The paths
    # are checked first: a daemon started where another serves stops before it makes any state.
    upstreams = {"unix": internal_socket(config.socket, "grpc")}
    upstreams["tcp"] = upstreams["unix"]
    if config.tcp_address and config.tls_cert:
        upstreams["tcp"] = internal_socket(config.socket, "grpc-tls")  # TLS ends at gRPC: the gate passes bytes
    for path in (config.socket, config.descriptor_socket, *set(upstreams.values())):
        prepare_socket_path(path, config.socket_group)
    metrics = DaemonMetrics()
    claims = ClaimTable()
    gpus = _native.cuda_device_uuids() if _native.WITH_CUDA else []
    executor = ThreadPoolExecutor(config.service_threads, thread_name_prefix="nodecomm-service")
    # A job's private daemon keeps its key in its job's directory: it lives as long as that does
    # (a daemon killed leaves it for the next, one that leaves removes it: job_lease.py).
    adoption_key = load_key(os.path.dirname(os.path.abspath(config.socket)) if config.private else config.state_dir)
    handbacks = HandbackTable(_native.CONTROL_BYTES, config.claim_token_ttl_seconds)
    registry = GroupRegistry(config, metrics, claims, gpus, executor, adoption_key, handbacks)
    # Where calibrations are read (the newer of them is used) and written: the node's state, or for
    # a job's private daemon the node's state, read-only, beside the user's own cache.
    store = CalibrationStore(config.state_dir)
    stores = [store]
    if config.private:
        store = CalibrationStore(config.cache_dir, private=True)
        # The node's state is trusted as its daemon is: root's, this user's or NODECOMM_DAEMON_USER's.
        stores = [CalibrationStore(config.state_dir, writable=False, owners=trust.node_daemon_uids()), store]
        registry.tables.live_store = store
    # A calibration measured on this machine before (same fingerprint) is used without probing.
    uncalibrated = registry.tables.reuse_stored(stores)
    for kind in registry.tables.fingerprints:
        log.info("dispatch table in force", extra={"device_kind": kind, "origin": registry.tables.origin(kind)})
    if uncalibrated:
        log.info(
            "no stored calibration for this machine",
            extra={"state_dir": config.state_dir, "device_kinds": uncalibrated},
        )

    identities = IdentityTable()
    admission = Admission(
        parse_ids("allowed_uids", config.allowed_uids),
        parse_ids("allowed_gids", config.allowed_gids),
        parse_ids("operator_uids", config.operator_uids),
    )
    claim_log = RateLimitedLog(log)  # each outcome at most once a second: floods stay a trickle
    descriptors = DescriptorServer(
        config.descriptor_socket,
        claims,
        on_claim=lambda result, detail: (
            metrics.claims.labels(result).inc(),
            claim_log.log(
                logging.INFO if result in ("ok", "identified", "handed_back") else logging.WARNING,
                result,
                "descriptor claim",
                result=result,
                detail=detail,
            ),
        ),  # fmt: skip
        identities=identities,
        admission=admission,
        identity_ttl=config.claim_token_ttl_seconds,
        handbacks=handbacks,
    )
    restrict_socket_file(config.descriptor_socket, 0o660, config.socket_group)

    # A connection holds three descriptors (the gate's two and gRPC's): a quarter of them at most.
    max_connections = min(config.max_connections, max(64, descriptor_limit // 4))
    if max_connections < config.max_connections:
        log.warning(
            "fewer connections than max_connections: the descriptor limit allows no more",
            extra={"max_connections": max_connections, "descriptor_limit": descriptor_limit},
        )
    gate = Gate(
        upstreams,
        admission,
        max_connections,
        config.max_connections_per_caller,
        on_refusal=lambda reason: metrics.connections_refused.labels(reason).inc(),
        on_count=metrics.connections.set,
    )
    server = grpc.aio.server(
        interceptors=[GateInterceptor(gate)],
        options=[
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            # Every control message is small (the largest a client sends is a batch of 32 timings):
            # a bigger one ends its call before the daemon spends time parsing it.
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # A connection that has not finished its HTTP/2 handshake in 3 s is closed, and one with
            # no call in flight for connection_idle_seconds: connections that only answer pings
            # cannot pile up to the descriptor limit.
            ("grpc.server_handshake_timeout_ms", 3000),
            ("grpc.max_connection_idle_ms", int(config.connection_idle_seconds * 1000)),
        ],
    )
    add_control_servicer(
        ControlServicer(registry, metrics, config, store, Identity(gate, identities, admission)), server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    server.add_insecure_port(f"unix:{upstreams['unix']}")
    if upstreams["tcp"] != upstreams["unix"]:
        server.add_secure_port(f"unix:{upstreams['tcp']}", tls_credentials(config))

    endpoint = None
    if config.metrics_host_port is not None:
        endpoint = MetricsEndpoint(metrics.registry, *config.metrics_host_port)
        await endpoint.start()

    await server.start()
    for path in set(upstreams.values()):
        os.chmod(path, 0o600)  # the gate's alone (connecting needs write permission, never given)
    await gate.listen_unix(listen_unix(config.socket, config.socket_group))
    if config.tcp_address:
        host, port = config.tcp_address.rsplit(":", 1)
        await gate.listen_tcp(host.strip("[]"), int(port))
    descriptors.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    lease = (
        JobLease(config.socket, config.private_grace_seconds, stop.set, (config.state_dir, config.cache_dir))
        if config.private
        else None
    )
    if lease is not None:
        await lease.start()

    async def sweep_tokens() -> None:
        while True:
            await asyncio.sleep(max(1.0, config.claim_token_ttl_seconds / 4))
            dropped = claims.drop_expired() + handbacks.drop_expired()
            if dropped:
                metrics.claims.labels("expired").inc(dropped)
            registry.sweep()

    async def notice_aborts() -> None:
        while True:
            await asyncio.sleep(ABORT_NOTICE_SECONDS)
            registry.notice_aborts()

    sweeper = asyncio.ensure_future(sweep_tokens())
    noticer = asyncio.ensure_future(notice_aborts())
    log.info(
        "nodecommd serving",
        extra={
            "socket": config.socket,
            "descriptor_socket": config.descriptor_socket,
            "tcp_address": config.tcp_address or None,
            "metrics_address": (
                f"{endpoint.address[0]}:{endpoint.address[1]}" if endpoint and endpoint.address else None
            ),
            "pid": os.getpid(),
            "private": config.private,
            "gpus": gpus,
            "thresholds": {
                kind: [b.describe() for b in registry.tables.default_boundaries(kind).values()] for kind in DeviceKind
            },
        },
    )
    probe = None
    if uncalibrated and config.calibrate_on_start:
        probe = asyncio.ensure_future(_calibrate_on_start(registry, config, store, uncalibrated))
    await stop.wait()
    if probe is not None:
        probe.cancel()

    await health_servicer.enter_graceful_shutdown()
    log.info("draining" if config.drain_on_stop else "stopping: running groups go on without this daemon")
    registry.stop(drain=config.drain_on_stop)
    await server.stop(config.drain_grace_seconds)
    await gate.close()
    sweeper.cancel()
    noticer.cancel()
    descriptors.stop()
    executor.shutdown(wait=True)
    if endpoint is not None:
        await endpoint.close()
    for path in (config.socket, *set(upstreams.values())):
        if os.path.exists(path):
            os.unlink(path)
    remove_internal_directories(upstreams.values())
    if lease is not None:
        lease.close()
    log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(argv)
        configure_logging(config.log_level, config.log_format)
        return uvloop.run(serve(config))
    except (ValueError, OSError, NodecommError) as error:
        print(f"nodecommd: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
