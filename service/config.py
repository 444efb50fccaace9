"""The daemon's configuration: one frozen dataclass, one precedence rule.

    built-in defaults  <  TOML file (--config / NODECOMM_CONFIG)  <  NODECOMM_* environment  <  flags

Every field can be set at every level under the same name: `socket` in the file, NODECOMM_SOCKET in
the environment, --socket on the command line. Byte sizes accept what parse_byte_size accepts.
"""

from __future__ import annotations

import argparse
import dataclasses
import grp
import ipaddress
import os
import pwd
from collections.abc import Mapping, Sequence
from typing import Any

import tomllib

from nodecomm.byte_size import format_byte_size, parse_byte_size
from nodecomm.capabilities import DeviceKind
from nodecomm.captured_abort import POLICIES as CAPTURED_ABORT_POLICIES
from nodecomm.evidence import LivePolicy
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


@dataclasses.dataclass(frozen=True)
class DaemonConfig:
    socket: str = dataclasses.field(default_factory=default_socket_path)
    # "host:port" on a loopback address, or empty for no TCP listener. Another address needs TLS:
    # tls_cert and tls_key (PEM files), and tls_client_ca to require client certificates. A Join
    # over TCP needs a group key; a loopback caller counts as the uid that owns its socket.
    tcp_address: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # Who may use the daemon. The sockets are 0660 and their directory 0750, owned by
    # socket_group (a group name or gid; empty: the daemon's own group). With allowed_uids or
    # allowed_gids (comma-separated ids or names), every call on a connection from another uid is
    # refused (the daemon reads each connection's SO_PEERCRED; its own uid is always allowed),
    # and a Join over TCP must carry an identity the descriptor socket issued.
    socket_group: str = ""
    allowed_uids: str = ""
    allowed_gids: str = ""
    # Who may change what every group on the node gets (Calibrate) and see every uid's groups:
    # these uids (ids or names); empty: root and the daemon's own uid.
    operator_uids: str = ""
    # Group names are per uid (service/access/callers.py): a group forms among joins of one uid unless
    # this lets several share one namespace. With require_group_key, every Join must carry a
    # group key (the first fixes it, later ones must match); off by default: other uids never
    # reach a group anyway, and a key is what keeps a process of the same uid out, which the
    # engines' integrations add on their own.
    allow_mixed_uids: bool = False
    require_group_key: bool = False
    # "host:port" for Prometheus /metrics, or "off".
    metrics_address: str = "127.0.0.1:9464"
    # Where calibrations persist; empty: /var/lib/nodecomm as root, else $XDG_STATE_HOME/nodecomm.
    state_dir: str = ""
    # A private daemon's own calibrations (what it probed, and the boundaries its groups' live
    # timings moved), kept for the user's next private daemon on this machine; made 0700 and
    # checked to be the user's own. Empty: $XDG_CACHE_HOME/nodecomm, else ~/.cache/nodecomm.
    cache_dir: str = ""
    # Probe at start when state_dir holds no calibration for this machine's fingerprint (a new
    # machine, or a changed processor or build); otherwise only `nodecomm calibrate` probes.
    calibrate_on_start: bool = False
    join_timeout_seconds: float = 60.0
    operation_timeout_seconds: float = 60.0
    # A rank that does not open its Session stream this long after Join is treated as lost.
    session_grace_seconds: float = 10.0
    # A claim token not used within this long is dropped.
    claim_token_ttl_seconds: float = 60.0
    timing_sample_period: int = 64
    # Live recalibration: where the ranks' sampled timings show another lossless path faster than
    # the table's by more than live_margin in a size bucket (the part of it on one side of every
    # boundary), once every rank has live_min_samples samples of both there, the boundaries move
    # so that the faster path takes it. Ranks switch tables together on every
    # table_switch_period-th all-reduce that is not being captured.
    live_recalibration: bool = True
    live_margin: float = LivePolicy.margin
    live_min_samples: int = LivePolicy.min_samples
    table_switch_period: int = LivePolicy.switch_period
    # Exploration, so that a wrong table is found out: every explore_period-th all-reduce of a size
    # bucket runs on another lossless path (the same bits) and is timed, the least timed of those
    # live recalibration has not yet found slower there by live_margin, and the next call is timed
    # on the table's own path; once none is left, one in 256 times as many does (native/dispatch.h).
    # Never into or out of NCCL, never while capturing; 0 switches it off, as does
    # live_recalibration = false.
    explore_period: int = LivePolicy.explore_period
    # When a group aborts while CUDA graphs hold a rank's calls (their replays would return without
    # their result): "exit" ends the rank's process with one line naming the group, the rank and the
    # reason, as torch's NCCL watchdog does; "log" only writes the line, and the rank's
    # Communicator.check() and next call raise. A job's NODECOMM_CAPTURED_ABORT wins over it.
    captured_abort: str = "exit"
    max_capacity_bytes: int = 1 << 30
    # All groups' buffers together; a Join past it gets RESOURCE_EXHAUSTED before allocating.
    max_reserved_bytes: int = 16 << 30
    # Per-daemon quotas, past which a Join gets RESOURCE_EXHAUSTED before anything is allocated:
    # groups formed or forming, ranks in one group, bytes of buffers on any one GPU.
    max_groups: int = 256
    max_ranks_per_group: int = 16
    max_bytes_per_gpu: int = 16 << 30
    # What one rank may hold open at once: service-path allocations, and top-k exchanges per group
    # (each holds a descriptor and a mapping in the daemon, whatever its size).
    max_allocations_per_rank: int = 64
    # The same, over every group one caller (the first joiner's uid) formed: its service-path
    # allocations and top-k exchanges together, so that many small groups cannot add up past it.
    max_allocations_per_caller: int = 1024
    # A caller is a uid (TCP callers the daemon cannot attribute to one share one): every global
    # limit has a share no single caller may pass. Groups one caller may have forming at once,
    # and formed and forming together; bytes of buffers its groups may reserve.
    max_forming_groups_per_caller: int = 32
    max_groups_per_caller: int = 64
    max_reserved_bytes_per_caller: int = 8 << 30
    # Connections to the control socket (and the TCP listener) at once, in all and per caller;
    # past either, a new one's calls are answered why, and it is closed (service/access/connections.py).
    # Each holds three descriptors.
    # gRPC closes a connection with no call in flight for connection_idle_seconds.
    max_connections: int = 4096
    max_connections_per_caller: int = 256
    connection_idle_seconds: float = 60.0
    # Timings one rank's session may report per second (a burst of as many); past it they are
    # dropped, so that one rank's stream costs the daemon a bounded share of its time.
    timing_rate_per_rank: int = 1000
    # Timings all of one caller's ranks may report per second together: its sessions' messages
    # are read at a shared pace, so that many one-rank groups cost the daemon one caller's share.
    timing_rate_per_caller: int = 16000
    max_topk_exchanges_per_group: int = 32
    drain_grace_seconds: float = 5.0
    # On SIGTERM/SIGINT: leave the running groups to their ranks (False: a restart or an upgrade
    # costs them nothing), or abort every group first (True: an operator who wants them gone).
    drain_on_stop: bool = False
    # The service path: collectives a group may have queued past the next one to run (a submit
    # beyond gets RESOURCE_EXHAUSTED), and the worker threads that run every group's collectives.
    service_queue_depth: int = 64
    service_threads: int = 4
    # Let the ranks of one CUDA group share a GPU: for development and tests on a one-GPU machine,
    # where several rank processes then stand in for several GPUs.
    allow_shared_devices: bool = False
    # A job's own daemon, started by its ranks where no node daemon answers: it exits once none of
    # the job's processes has held its lease socket (<socket>.lease) for private_grace_seconds,
    # removing its sockets and directory. It reads the calibrations in state_dir and cache_dir (the
    # newer one for this machine is in force) and writes to cache_dir only.
    private: bool = False
    private_grace_seconds: float = 2.0
    # How CUDA groups' buffers cross to the ranks: "vmm" (POSIX descriptors), "legacy"
    # (cudaIpcMemHandle bytes in the reply), or "auto": vmm, and legacy where the driver cannot
    # export VMM allocations.
    cuda_memory: str = "auto"
    # How a CUDA group's service path orders the daemon's stream after the ranks' inputs and the
    # ranks' streams after its sums: "stream-words" (counters in the group's buffers, written and
    # waited on by stream memory operations: nothing beyond the buffers' descriptors), "ipc-events"
    # (cudaIpcEventHandle: needs a /dev/shm shared with the ranks), or "auto": stream words where
    # every GPU of the group runs 64-bit stream memory operations, else IPC events.
    cuda_service_ordering: str = "auto"
    log_level: str = "INFO"
    log_format: str = "json"
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
        _check_directory("state_dir", self.state_dir)
        if bool(self.tls_cert) != bool(self.tls_key) or (self.tls_client_ca and not self.tls_cert):
            raise ValueError("tls_cert and tls_key: expected both (PEM files) or neither; tls_client_ca needs them")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            if getattr(self, name) and not os.path.isfile(getattr(self, name)):
                raise ValueError(f"{name} {getattr(self, name)!r}: no such file")
        if self.tcp_address:
            host = _split_address("tcp_address", self.tcp_address)[0]
            if not ipaddress.ip_address(host).is_loopback and not self.tls_cert:
                raise ValueError(
                    f"tcp_address {self.tcp_address!r}: expected a loopback address (127.0.0.0/8 or ::1), or "
                    "tls_cert and tls_key for any other; the control plane is not exposed in the clear"
                )
        for name in ("allowed_uids", "allowed_gids", "operator_uids"):
            parse_ids(name, getattr(self, name))
        if self.socket_group:
            parse_ids("socket_group", self.socket_group)
        for name in (
            "max_groups",
            "max_ranks_per_group",
            "max_allocations_per_rank",
            "max_allocations_per_caller",
            "max_topk_exchanges_per_group",
            "max_forming_groups_per_caller",
            "max_groups_per_caller",
            "max_connections",
            "max_connections_per_caller",
            "timing_rate_per_rank",
            "timing_rate_per_caller",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {getattr(self, name)!r}")
        if self.metrics_address != "off":
            _split_address("metrics_address", self.metrics_address)
        for name in (
            "join_timeout_seconds",
            "operation_timeout_seconds",
            "session_grace_seconds",
            "claim_token_ttl_seconds",
            "drain_grace_seconds",
            "private_grace_seconds",
            "connection_idle_seconds",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected a positive number of seconds, got {getattr(self, name)!r}")
        if not 0 <= self.live_margin < 1:
            raise ValueError(f"live_margin: expected a fraction in [0, 1), got {self.live_margin!r}")
        if self.explore_period < 0:
            raise ValueError(f"explore_period: expected 0 (off) or a positive integer, got {self.explore_period!r}")
        for name in ("live_min_samples", "table_switch_period", "service_queue_depth", "service_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {getattr(self, name)!r}")
        if self.timing_sample_period < 1:
            raise ValueError(f"timing_sample_period: expected an integer >= 1, got {self.timing_sample_period}")
        for name in ("max_capacity_bytes", "max_reserved_bytes", "max_reserved_bytes_per_caller", "max_bytes_per_gpu"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 64:
                raise ValueError(f"{name}: expected a byte size of at least 64, got {getattr(self, name)!r}")
        unknown = set(self.overrides) - set(BOUNDARY_NAMES)
        if unknown:
            raise ValueError(f"unknown threshold overrides {sorted(unknown)}: expected {list(BOUNDARY_NAMES)}")
        if self.cuda_memory not in ("auto", "vmm", "legacy"):
            raise ValueError(f"cuda_memory: expected 'auto', 'vmm' or 'legacy', got {self.cuda_memory!r}")
        if self.cuda_service_ordering not in ("auto", "stream-words", "ipc-events"):
            raise ValueError(
                f"cuda_service_ordering: expected 'auto', 'stream-words' or 'ipc-events', got {self.cuda_service_ordering!r}"
            )
        if self.captured_abort not in CAPTURED_ABORT_POLICIES:
            raise ValueError(f"captured_abort: expected 'exit' or 'log', got {self.captured_abort!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"log_level {self.log_level!r}: expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
        if self.log_format not in ("json", "text"):
            raise ValueError(f"log_format: expected 'json' or 'text', got {self.log_format!r}")
        object.__setattr__(self, "overrides", dict(self.overrides))

    @property
    def metrics_host_port(self) -> tuple[str, int] | None:
        return None if self.metrics_address == "off" else _split_address("metrics_address", self.metrics_address)


def parse_ids(field: str, text: str) -> frozenset[int]:
    """Comma-separated numeric ids or names: uids for allowed_uids and operator_uids, gids otherwise."""
    ids = set()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item.isdigit():
            ids.add(int(item))
            continue
        try:
            ids.add(pwd.getpwnam(item).pw_uid if field.endswith("_uids") else grp.getgrnam(item).gr_gid)
        except KeyError:
            kind = "user" if field.endswith("_uids") else "group"
            raise ValueError(f"{field}: no {kind} named {item!r}; expected ids or names, comma-separated") from None
    return frozenset(ids)


def _check_directory(name: str, path: str) -> None:
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


def _split_address(field: str, address: str) -> tuple[str, int]:
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


_FIELDS = {f.name: f for f in dataclasses.fields(DaemonConfig) if f.name != "overrides"}

# One line per setting for `nodecommd --help` (docs/operator-guide.md says more).
HELP = {
    "socket": "Unix socket of the gRPC control plane",
    "tcp_address": "extra gRPC listener, ip:port on loopback (or with TLS); empty: none",
    "tls_cert": "PEM certificate for tcp_address beyond loopback",
    "tls_key": "PEM key for tls_cert",
    "tls_client_ca": "PEM CA that TCP clients' certificates must chain to",
    "socket_group": "group (name or gid) of the sockets and their directory; empty: the daemon's",
    "allowed_uids": "comma-separated uids or user names that may join; empty: anyone who reaches the socket",
    "allowed_gids": "comma-separated gids or group names that may join",
    "operator_uids": "comma-separated uids or user names that may calibrate; empty: root and the daemon's uid",
    "metrics_address": "ip:port of Prometheus /metrics, or off",
    "state_dir": "where calibrations are stored",
    "cache_dir": "where a private daemon keeps what it measured, for the user's next one",
    "calibrate_on_start": "probe at start where state_dir holds no calibration for this machine",
    "join_timeout_seconds": "longest a Join waits for the group's other ranks",
    "operation_timeout_seconds": "longest one collective waits for a peer",
    "session_grace_seconds": "a rank without a Session stream this long after its group formed is lost",
    "claim_token_ttl_seconds": "a descriptor claim token unused this long is dropped",
    "timing_sample_period": "each rank times one all-reduce in this many",
    "live_recalibration": "move boundaries from the ranks' sampled timings",
    "live_margin": "how much faster another path must be to move a boundary (fraction)",
    "live_min_samples": "samples of both paths every rank needs in a size bucket",
    "table_switch_period": "ranks switch to a new table together every this many all-reduces",
    "explore_period": "every n-th all-reduce of a size bucket runs on another lossless path not yet found slower, "
    "and is timed; once none is left, one in 256n; 0: off",
    "captured_abort": "when a group aborts while CUDA graphs hold a rank's calls: exit (end the rank's process) or log",
    "max_capacity_bytes": "largest slot capacity a group may ask for",
    "max_reserved_bytes": "cap on everything reserved, all groups together",
    "max_groups": "groups formed or forming at once",
    "max_allocations_per_rank": "service-path allocations one rank may hold open",
    "max_allocations_per_caller": "service-path allocations and top-k exchanges one uid's groups may hold open",
    "max_forming_groups_per_caller": "groups one uid may have forming at once",
    "max_groups_per_caller": "groups one uid may have formed and forming at once",
    "max_reserved_bytes_per_caller": "bytes of buffers one uid's groups may reserve",
    "max_connections": "connections to the control socket and TCP listener at once",
    "max_connections_per_caller": "of those, connections one uid may hold",
    "connection_idle_seconds": "a connection with no call in flight this long is closed",
    "timing_rate_per_rank": "timings per second one rank may report; more are dropped",
    "timing_rate_per_caller": "timings per second all of one uid's ranks may report together",
    "allow_mixed_uids": "let ranks of several uids form one group",
    "require_group_key": "refuse joins that carry no group key",
    "max_topk_exchanges_per_group": "top-k exchanges one group may hold open",
    "max_ranks_per_group": "largest world size a Join may ask for",
    "max_bytes_per_gpu": "buffers one GPU may hold",
    "drain_grace_seconds": "on SIGTERM, how long running calls get before the server stops",
    "drain_on_stop": "on SIGTERM, abort every group first (false: running groups go on without the daemon)",
    "service_queue_depth": "service-path collectives a group may queue",
    "service_threads": "threads that run every group's service-path collectives",
    "allow_shared_devices": "let the ranks of one CUDA group share a GPU (development)",
    "private": "a job's own daemon, started by its ranks: exits when the job's leases end, writes no state",
    "private_grace_seconds": "how long a private daemon outlives its job's last lease",
    "cuda_memory": "how CUDA buffers cross to the ranks: auto, vmm or legacy",
    "cuda_service_ordering": "how the CUDA service path orders streams: auto, stream-words or ipc-events",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "log_format": "json or text",
}


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
    for name, field in _FIELDS.items():
        metavar = "SIZE" if _is_size(name, field) else field.type.upper()
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            metavar=metavar,
            help=f"{HELP[name]} (default: {_shown_default(name, field)})",
        )
    for name in BOUNDARY_NAMES:
        path = name.split("_")[0]
        parser.add_argument(
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
