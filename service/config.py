"""The daemon's configuration: one frozen dataclass, one precedence rule.

    built-in defaults  <  TOML file (--config / NODECOMM_CONFIG)  <  NODECOMM_* environment  <  flags

Every field can be set at every level under the same name: `socket` in the file, NODECOMM_SOCKET in
the environment, --socket on the command line. Byte sizes accept what parse_byte_size accepts.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
from collections.abc import Mapping, Sequence
from typing import Any

import tomllib

from nodecomm.byte_size import format_byte_size, parse_byte_size
from nodecomm.capabilities import DeviceKind
from nodecomm.captured_abort import POLICIES as CAPTURED_ABORT_POLICIES
from nodecomm.evidence import LivePolicy
from nodecomm.service.config_checks import (
    Check,
    address_or_off,
    at_least_one,
    byte_limit,
    check_directory,
    fraction,
    ids,
    level_name,
    one_of,
    pem_file,
    period_or_off,
    seconds,
    split_address,
)
from nodecomm.socket_path import default_socket_path, descriptor_socket_path
from nodecomm.thresholds import BOUNDARY_NAMES

ENV_PREFIX = "NODECOMM_"

# Built-in boundaries per device kind, the last word when neither an override nor calibration
# sets one. CPU: oneshot_max_bytes was read off `nodecomm bench --device cpu --world-size 2` on a
# 2-core machine (oneshot wins below it, twoshot above); CPU groups have no DMA path, and the
# service path (the daemon runs the collective) wins no size there, so it is off. CUDA:
# oneshot for latency-bound sizes, copy engines from 6 MiB, and between them NCCL where the ranks
# pass an NCCL group (twoshot otherwise) until calibration measures the machine.
DEFAULT_BOUNDARIES: dict[str, dict[str, int | None]] = {
    # compressed_min_bytes: off until calibrated or overridden, and only for groups that ask.
    DeviceKind.CPU: {"oneshot_max_bytes": 32 << 10, "service_min_bytes": None, "compressed_min_bytes": None},
    DeviceKind.CUDA: {
        "oneshot_max_bytes": 256 << 10,
        "twoshot_max_bytes": None,
        "dma_min_bytes": 6 << 20,
        "service_min_bytes": None,
        "compressed_min_bytes": None,
    },
}


def default_state_dir() -> str:
    """/var/lib/nodecomm as root, else $XDG_STATE_HOME/nodecomm (~/.local/state/nodecomm)."""
    if os.geteuid() == 0:
        return "/var/lib/nodecomm"
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "nodecomm")


def default_cache_dir() -> str:
    """$XDG_CACHE_HOME/nodecomm, else ~/.cache/nodecomm."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nodecomm")


# The areas settings are grouped in, in `nodecommd --help` and in docs/operator-guide.md.
AREAS = ("listening", "access", "state", "timeouts", "limits", "live thresholds", "service path", "CUDA", "logging")


def setting(default: Any = dataclasses.MISSING, *, area: str, help: str, check: Check | None = None, factory=None):
    """A DaemonConfig field: its default, its area, its line of --help and its constraint."""
    metadata = {"area": area, "help": help, "check": check}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class DaemonConfig:
    # -- listening ---------------------------------------------------------------------------------
    socket: str = setting(area="listening", help="Unix socket of the gRPC control plane", factory=default_socket_path)
    # "host:port" on a loopback address, or empty for no TCP listener. Another address needs TLS:
    # tls_cert and tls_key (PEM files), and tls_client_ca to require client certificates. A Join
    # over TCP needs a group key; a loopback caller counts as the uid that owns its socket.
    tcp_address: str = setting(
        "", area="listening", help="extra gRPC listener, ip:port on loopback (or with TLS); empty: none"
    )
    tls_cert: str = setting(
        "", area="listening", help="PEM certificate for tcp_address beyond loopback", check=pem_file
    )
    tls_key: str = setting("", area="listening", help="PEM key for tls_cert", check=pem_file)
    tls_client_ca: str = setting(
        "", area="listening", help="PEM CA that TCP clients' certificates must chain to", check=pem_file
    )
    # "host:port" for Prometheus /metrics, or "off".
    metrics_address: str = setting(
        "127.0.0.1:9464", area="listening", help="ip:port of Prometheus /metrics, or off", check=address_or_off
    )
    # Connections to the control socket (and the TCP listener) at once, in all and per caller;
    # past either, a new one's calls are answered why, and it is closed (service/access/connections.py).
    # Each holds three descriptors. gRPC closes a connection with no call in flight for
    # connection_idle_seconds.
    max_connections: int = setting(
        4096, area="listening", help="connections to the control socket and TCP listener at once", check=at_least_one
    )
    max_connections_per_caller: int = setting(
        256, area="listening", help="of those, connections one uid may hold", check=at_least_one
    )
    connection_idle_seconds: float = setting(
        60.0, area="listening", help="a connection with no call in flight this long is closed", check=seconds
    )

    # -- access ------------------------------------------------------------------------------------
    # Who may use the daemon. The sockets are 0660 and their directory 0750, owned by
    # socket_group (a group name or gid; empty: the daemon's own group). With allowed_uids or
    # allowed_gids (comma-separated ids or names), every call on a connection from another uid is
    # refused (the daemon reads each connection's SO_PEERCRED; its own uid is always allowed),
    # and a Join over TCP must carry an identity the descriptor socket issued.
    socket_group: str = setting(
        "",
        area="access",
        help="group (name or gid) of the sockets and their directory; empty: the daemon's",
        check=ids,
    )
    allowed_uids: str = setting(
        "",
        area="access",
        help="comma-separated uids or user names that may join; empty: anyone who reaches the socket",
        check=ids,
    )
    allowed_gids: str = setting("", area="access", help="comma-separated gids or group names that may join", check=ids)
    # Who may change what every group on the node gets (Calibrate) and see every uid's groups:
    # these uids (ids or names); empty: root and the daemon's own uid.
    operator_uids: str = setting(
        "",
        area="access",
        help="comma-separated uids or user names that may calibrate; empty: root and the daemon's uid",
        check=ids,
    )
    # Group names are per uid (service/access/callers.py): a group forms among joins of one uid unless
    # this lets several share one namespace. With require_group_key, every Join must carry a
    # group key (the first fixes it, later ones must match); off by default: other uids never
    # reach a group anyway, and a key is what keeps a process of the same uid out, which the
    # engines' integrations add on their own.
    allow_mixed_uids: bool = setting(False, area="access", help="let ranks of several uids form one group")
    require_group_key: bool = setting(False, area="access", help="refuse joins that carry no group key")

    # -- state -------------------------------------------------------------------------------------
    # Where calibrations persist; empty: /var/lib/nodecomm as root, else $XDG_STATE_HOME/nodecomm.
    state_dir: str = setting("", area="state", help="where calibrations are stored")
    # A private daemon's own calibrations (what it probed, and the boundaries its groups' live
    # timings moved), kept for the user's next private daemon on this machine; made 0700 and
    # checked to be the user's own. Empty: $XDG_CACHE_HOME/nodecomm, else ~/.cache/nodecomm.
    cache_dir: str = setting(
        "", area="state", help="where a private daemon keeps what it measured, for the user's next one"
    )
    # Probe at start when state_dir holds no calibration for this machine's fingerprint (a new
    # machine, or a changed processor or build); otherwise only `nodecomm calibrate` probes.
    calibrate_on_start: bool = setting(
        False, area="state", help="probe at start where state_dir holds no calibration for this machine"
    )
    # A job's own daemon, started by its ranks where no node daemon answers: it exits once none of
    # the job's processes has held its lease socket (<socket>.lease) for private_grace_seconds,
    # removing its sockets and directory. It reads the calibrations in state_dir and cache_dir (the
    # newer one for this machine is in force) and writes to cache_dir only.
    private: bool = setting(
        False,
        area="state",
        help="a job's own daemon, started by its ranks: exits when the job's leases end, writes no state",
    )
    private_grace_seconds: float = setting(
        2.0, area="state", help="how long a private daemon outlives its job's last lease", check=seconds
    )

    # -- timeouts ----------------------------------------------------------------------------------
    join_timeout_seconds: float = setting(
        60.0, area="timeouts", help="longest a Join waits for the group's other ranks", check=seconds
    )
    operation_timeout_seconds: float = setting(
        60.0, area="timeouts", help="longest one collective waits for a peer", check=seconds
    )
    # A rank that does not open its Session stream this long after Join is treated as lost.
    session_grace_seconds: float = setting(
        10.0,
        area="timeouts",
        help="a rank without a Session stream this long after its group formed is lost",
        check=seconds,
    )
    # A claim token not used within this long is dropped.
    claim_token_ttl_seconds: float = setting(
        60.0, area="timeouts", help="a descriptor claim token unused this long is dropped", check=seconds
    )
    drain_grace_seconds: float = setting(
        5.0, area="timeouts", help="on SIGTERM, how long running calls get before the server stops", check=seconds
    )
    # On SIGTERM/SIGINT: leave the running groups to their ranks (False: a restart or an upgrade
    # costs them nothing), or abort every group first (True: an operator who wants them gone).
    drain_on_stop: bool = setting(
        False,
        area="timeouts",
        help="on SIGTERM, abort every group first (false: running groups go on without the daemon)",
    )

    # -- limits ------------------------------------------------------------------------------------
    # Past any of these a Join gets RESOURCE_EXHAUSTED before anything is allocated. A caller is a
    # uid (TCP callers the daemon cannot attribute to one share one): every global limit has a
    # share no single caller may pass.
    max_capacity_bytes: int = setting(
        1 << 30, area="limits", help="largest slot capacity a group may ask for", check=byte_limit
    )
    # All groups' buffers together.
    max_reserved_bytes: int = setting(
        16 << 30, area="limits", help="cap on everything reserved, all groups together", check=byte_limit
    )
    max_reserved_bytes_per_caller: int = setting(
        8 << 30, area="limits", help="bytes of buffers one uid's groups may reserve", check=byte_limit
    )
    max_bytes_per_gpu: int = setting(16 << 30, area="limits", help="buffers one GPU may hold", check=byte_limit)
    # Groups formed or forming; ranks in one group.
    max_groups: int = setting(256, area="limits", help="groups formed or forming at once", check=at_least_one)
    max_groups_per_caller: int = setting(
        64, area="limits", help="groups one uid may have formed and forming at once", check=at_least_one
    )
    max_forming_groups_per_caller: int = setting(
        32, area="limits", help="groups one uid may have forming at once", check=at_least_one
    )
    max_ranks_per_group: int = setting(
        16, area="limits", help="largest world size a Join may ask for", check=at_least_one
    )
    # What one rank may hold open at once: service-path allocations, and top-k exchanges per group
    # (each holds a descriptor and a mapping in the daemon, whatever its size); the same over every
    # group one caller (the first joiner's uid) formed, so that many small groups cannot add up past it.
    max_allocations_per_rank: int = setting(
        64, area="limits", help="service-path allocations one rank may hold open", check=at_least_one
    )
    max_allocations_per_caller: int = setting(
        1024,
        area="limits",
        help="service-path allocations and top-k exchanges one uid's groups may hold open",
        check=at_least_one,
    )
    max_topk_exchanges_per_group: int = setting(
        32, area="limits", help="top-k exchanges one group may hold open", check=at_least_one
    )
    # Timings one rank's session may report per second (a burst of as many), past which they are
    # dropped; and all of one caller's ranks together: its sessions' messages are read at a shared
    # pace, so that many one-rank groups cost the daemon one caller's share.
    timing_rate_per_rank: int = setting(
        1000, area="limits", help="timings per second one rank may report; more are dropped", check=at_least_one
    )
    timing_rate_per_caller: int = setting(
        16000, area="limits", help="timings per second all of one uid's ranks may report together", check=at_least_one
    )

    # -- live thresholds ---------------------------------------------------------------------------
    timing_sample_period: int = setting(
        64, area="live thresholds", help="each rank times one all-reduce in this many", check=at_least_one
    )
    # Live recalibration: where the ranks' sampled timings show another lossless path faster than
    # the table's by more than live_margin in a size bucket (the part of it on one side of every
    # boundary), once every rank has live_min_samples samples of both there, the boundaries move
    # so that the faster path takes it. Ranks switch tables together on every
    # table_switch_period-th all-reduce that is not being captured.
    live_recalibration: bool = setting(
        True, area="live thresholds", help="move boundaries from the ranks' sampled timings"
    )
    live_margin: float = setting(
        LivePolicy.margin,
        area="live thresholds",
        help="how much faster another path must be to move a boundary (fraction)",
        check=fraction,
    )
    live_min_samples: int = setting(
        LivePolicy.min_samples,
        area="live thresholds",
        help="samples of both paths every rank needs in a size bucket",
        check=at_least_one,
    )
    table_switch_period: int = setting(
        LivePolicy.switch_period,
        area="live thresholds",
        help="ranks switch to a new table together every this many all-reduces",
        check=at_least_one,
    )
    # Exploration, so that a wrong table is found out: every explore_period-th all-reduce of a size
    # bucket runs on another lossless path (the same bits) and is timed, the least timed of those
    # live recalibration has not yet found slower there by live_margin, and the next call is timed
    # on the table's own path; once none is left, one in 256 times as many does (native/dispatch.h).
    # Never into or out of NCCL, never while capturing, never in a group that keeps its table
    # (table_switching=False); 0 switches it off, as does live_recalibration = false.
    explore_period: int = setting(
        LivePolicy.explore_period,
        area="live thresholds",
        help="every n-th all-reduce of a size bucket runs on another lossless path not yet found slower, and is timed; once none is left, one in 256n; 0: off",
        check=period_or_off,
    )

    # -- service path ------------------------------------------------------------------------------
    # Collectives a group may have queued past the next one to run (a submit beyond gets
    # RESOURCE_EXHAUSTED), and the worker threads that run every group's collectives.
    service_queue_depth: int = setting(
        64, area="service path", help="service-path collectives a group may queue", check=at_least_one
    )
    service_threads: int = setting(
        4, area="service path", help="threads that run every group's service-path collectives", check=at_least_one
    )

    # -- CUDA --------------------------------------------------------------------------------------
    # Let the ranks of one CUDA group share a GPU: for development and tests on a one-GPU machine,
    # where several rank processes then stand in for several GPUs.
    allow_shared_devices: bool = setting(
        False, area="CUDA", help="let the ranks of one CUDA group share a GPU (development)"
    )
    # How CUDA groups' buffers cross to the ranks: "vmm" (POSIX descriptors), "legacy"
    # (cudaIpcMemHandle bytes in the reply), or "auto": vmm, and legacy where the driver cannot
    # export VMM allocations.
    cuda_memory: str = setting(
        "auto",
        area="CUDA",
        help="how CUDA buffers cross to the ranks: auto, vmm or legacy",
        check=one_of("auto", "vmm", "legacy"),
    )
    # How a CUDA group's service path orders the daemon's stream after the ranks' inputs and the
    # ranks' streams after its sums: "stream-words" (counters in the group's buffers, written and
    # waited on by stream memory operations: nothing beyond the buffers' descriptors), "ipc-events"
    # (cudaIpcEventHandle: needs a /dev/shm shared with the ranks), or "auto": stream words where
    # every GPU of the group runs 64-bit stream memory operations, else IPC events.
    cuda_service_ordering: str = setting(
        "auto",
        area="CUDA",
        help="how the CUDA service path orders streams: auto, stream-words or ipc-events",
        check=one_of("auto", "stream-words", "ipc-events"),
    )
    # When a group aborts while CUDA graphs hold a rank's calls (their replays would return without
    # their result): "exit" ends the rank's process with one line naming the group, the rank and the
    # reason, as torch's NCCL watchdog does; "log" only writes the line, and the rank's
    # Communicator.check() and next call raise. A job's NODECOMM_CAPTURED_ABORT wins over it.
    captured_abort: str = setting(
        "exit",
        area="CUDA",
        help="when a group aborts while CUDA graphs hold a rank's calls: exit (end the rank's process) or log",
        check=one_of(*CAPTURED_ABORT_POLICIES),
    )

    # -- logging -----------------------------------------------------------------------------------
    log_level: str = setting("INFO", area="logging", help="DEBUG, INFO, WARNING or ERROR", check=level_name)
    log_format: str = setting("json", area="logging", help="json or text", check=one_of("json", "text"))

    # Boundary overrides: absent means "not overridden"; None means "switched off".
    overrides: Mapping[str, int | None] = dataclasses.field(default_factory=dict)

    @property
    def descriptor_socket(self) -> str:
        """The companion socket that passes file descriptors, always beside the control socket."""
        return descriptor_socket_path(self.socket)

    def __post_init__(self) -> None:
        if not self.socket:
            raise ValueError("socket: expected a filesystem path for the Unix socket, got an empty string")
        if not self.state_dir:
            object.__setattr__(self, "state_dir", default_state_dir())
        if not self.cache_dir:
            object.__setattr__(self, "cache_dir", default_cache_dir())
        check_directory("state_dir", self.state_dir)
        # What settings must agree on, before each is checked alone.
        if bool(self.tls_cert) != bool(self.tls_key) or (self.tls_client_ca and not self.tls_cert):
            raise ValueError("tls_cert and tls_key: expected both (PEM files) or neither; tls_client_ca needs them")
        for field in dataclasses.fields(self):
            check = field.metadata.get("check")
            if check is not None:
                check(field.name, getattr(self, field.name))
        if self.tcp_address:
            host = split_address("tcp_address", self.tcp_address)[0]
            if not ipaddress.ip_address(host).is_loopback and not self.tls_cert:
                raise ValueError(
                    f"tcp_address {self.tcp_address!r}: expected a loopback address (127.0.0.0/8 or ::1), or "
                    "tls_cert and tls_key for any other; the control plane is not exposed in the clear"
                )
        unknown = set(self.overrides) - set(BOUNDARY_NAMES)
        if unknown:
            raise ValueError(f"unknown threshold overrides {sorted(unknown)}: expected {list(BOUNDARY_NAMES)}")
        object.__setattr__(self, "overrides", dict(self.overrides))

    @property
    def metrics_host_port(self) -> tuple[str, int] | None:
        return None if self.metrics_address == "off" else split_address("metrics_address", self.metrics_address)


_FIELDS = {f.name: f for f in dataclasses.fields(DaemonConfig) if f.name != "overrides"}


def _coerce(name: str, value: Any, where: str) -> Any:
    """Turn a file, environment or flag value into the field's type, naming where it came from."""
    if name in BOUNDARY_NAMES:
        try:
            return parse_byte_size(str(value))
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
    kind = _FIELDS[name].type
    try:
        if _is_size(name, _FIELDS[name]):
            size = parse_byte_size(str(value))
            if size is None:
                raise ValueError("a limit cannot be switched off")
            return size
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true/false, yes/no, on/off or 1/0")
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        return str(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: expected {kind} for {name}, got {value!r} ({error})") from None


def _apply(values: dict[str, Any], overrides: dict[str, int | None], source: Mapping[str, Any], where: str) -> None:
    for key, value in source.items():
        name = key.replace("-", "_")
        if name == "thresholds" and isinstance(value, Mapping):
            _apply(values, overrides, value, f"{where} [thresholds]")
        elif name in BOUNDARY_NAMES:
            overrides[name] = _coerce(name, value, f"{where} {key}")
        elif name in _FIELDS:
            values[name] = _coerce(name, value, f"{where} {key}")
        else:
            known = ", ".join(sorted([*_FIELDS, *BOUNDARY_NAMES]))
            raise ValueError(f"{where}: unknown setting {key!r}; known settings: {known}")


def _shown_default(name: str, field: dataclasses.Field) -> str:
    if field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        value = field.default
    if name == "state_dir":
        return default_state_dir()  # what an empty value becomes
    if name == "cache_dir":
        return default_cache_dir()
    if _is_size(name, field):
        return format_byte_size(value)
    if isinstance(value, bool):
        return str(value).lower()
    return "empty" if value == "" else str(value)


def _is_size(name: str, field: dataclasses.Field) -> bool:
    return field.type == "int" and "_bytes" in name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nodecommd",
        description="The nodecomm daemon: owns a node's shared communication buffers and serves the control plane.",
        epilog=(
            "Every setting is also NODECOMM_<NAME> in the environment and <name> in the TOML file; flags win "
            "over the environment, the environment over the file. SIZE: 6291456, 512KiB, 24MB, 1GiB. BOOL: "
            "true/false, yes/no, on/off, 1/0. Thresholds: docs/operator-guide.md."
        ),
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file (also NODECOMM_CONFIG)")
    areas = {area: parser.add_argument_group(area) for area in AREAS}
    for name, field in _FIELDS.items():
        metavar = "SIZE" if _is_size(name, field) else field.type.upper()
        areas[field.metadata["area"]].add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            metavar=metavar,
            help=f"{field.metadata['help']} (default: {_shown_default(name, field)})",
        )
    thresholds = parser.add_argument_group("thresholds")
    for name in BOUNDARY_NAMES:
        path = name.split("_")[0]
        thresholds.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            metavar="SIZE|off",
            help=f"override where {path} {'ends' if name.endswith('_max_bytes') else 'starts'} for every group "
            "(default: calibrated, else built in)",
        )
    return parser


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> DaemonConfig:
    environ = os.environ if environ is None else environ
    flags = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    overrides: dict[str, int | None] = {}
    config_file = flags.pop("config", None) or environ.get(ENV_PREFIX + "CONFIG")
    if config_file:
        with open(config_file, "rb") as handle:
            try:
                settings = tomllib.load(handle)
            except tomllib.TOMLDecodeError as error:
                raise ValueError(f"config file {config_file}: not valid TOML ({error})") from None
        _apply(values, overrides, settings, f"config file {config_file}")
    env = {
        key[len(ENV_PREFIX) :].lower(): value
        for key, value in environ.items()
        if key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX) :].lower() in (*_FIELDS, *BOUNDARY_NAMES)
    }
    _apply(values, overrides, env, "environment")
    _apply(values, overrides, flags, "command line")
    return DaemonConfig(**values, overrides=overrides)
