"""The one way a process opens a gRPC channel to a daemon: once the daemon has proved who it is.

- A Unix socket (a path, or unix:PATH): its directories, its file and the process answering on it
  are checked (nodecomm.trust).
- TCP with TLS: the daemon's certificate must chain to the certificate authority the operator
  configured, NODECOMM_DAEMON_CA (a PEM file); NODECOMM_RANK_CERT and NODECOMM_RANK_KEY give this
  process a certificate of its own for a daemon that asks for one (its tls_client_ca), and
  NODECOMM_DAEMON_TLS_NAME names the daemon where its certificate does not name the address.
- TCP on a loopback address without TLS (ipv4:127.0.0.1:PORT, ipv6:[::1]:PORT): every socket
  where the connection could land must be owned by a uid the daemon may run as, checked before
  connecting and again once connected.
Any other TCP target is refused, with what to configure: whoever answers there may be anyone.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence

import grpc

from nodecomm import trust
from nodecomm.errors import DaemonUnavailableError, InvalidArgumentError, PermissionDeniedError
from nodecomm.socket_path import TCP_SCHEMES

# Named apart from the daemon's own tls_* settings (NODECOMM_TLS_CERT is the daemon's certificate).
TLS_CA_VARIABLE = "NODECOMM_DAEMON_CA"
TLS_CERT_VARIABLE = "NODECOMM_RANK_CERT"
TLS_KEY_VARIABLE = "NODECOMM_RANK_KEY"
TLS_SERVER_NAME_VARIABLE = "NODECOMM_DAEMON_TLS_NAME"

Options = Sequence[tuple[str, object]]


def open_channel(
    target: str, daemon_uids: frozenset[int], timeout: float = 5.0, options: Options = ()
) -> tuple[grpc.Channel, str]:
    """A channel to the daemon at `target` (a socket path, unix:PATH, or a TCP target) once it has
    proved who it is, and the target dialled (a socket's checked real path). Raises
    PermissionDeniedError for a daemon that cannot prove itself or fails the checks,
    DaemonUnavailableError where nothing serves."""
    if not target.startswith(TCP_SCHEMES):
        checked = trust.checked_target(target, daemon_uids, timeout)
        return grpc.insecure_channel(checked, options=list(options)), checked
    credentials = tls_credentials()
    if credentials is not None:
        server_name = os.environ.get(TLS_SERVER_NAME_VARIABLE)
        extra = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        return grpc.secure_channel(target, credentials, options=[*options, *extra]), target
    host, port = _loopback(target)
    trust.check_loopback_listener(host, port, daemon_uids)
    channel = grpc.insecure_channel(target, options=list(options))
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        trust.check_loopback_listener(host, port, daemon_uids)  # still the one checked before connecting
    except grpc.FutureTimeoutError:
        channel.close()
        raise DaemonUnavailableError(
            f"daemon unavailable: {target} did not answer as a gRPC server within {timeout} s (where it serves "
            f"TLS, set {TLS_CA_VARIABLE} to the authority that signed its certificate)"
        ) from None
    except BaseException:
        channel.close()
        raise
    return channel, target


def tls_credentials() -> grpc.ChannelCredentials | None:
    """The channel credentials NODECOMM_DAEMON_CA (and NODECOMM_RANK_CERT, NODECOMM_RANK_KEY) name;
    None where no certificate authority is configured."""
    ca = os.environ.get(TLS_CA_VARIABLE)
    if not ca:
        return None
    cert, key = os.environ.get(TLS_CERT_VARIABLE), os.environ.get(TLS_KEY_VARIABLE)
    if bool(cert) != bool(key):
        raise InvalidArgumentError(f"{TLS_CERT_VARIABLE} and {TLS_KEY_VARIABLE}: expected both (PEM files) or neither")

    def read(variable: str, path: str) -> bytes:
        try:
            with open(path, "rb") as handle:
                return handle.read()
        except OSError as error:
            raise InvalidArgumentError(f"{variable} {path!r}: {error.strerror}; expected a PEM file") from None

    return grpc.ssl_channel_credentials(
        root_certificates=read(TLS_CA_VARIABLE, ca),
        private_key=read(TLS_KEY_VARIABLE, key) if key else None,
        certificate_chain=read(TLS_CERT_VARIABLE, cert) if cert else None,
    )


def _loopback(target: str) -> tuple[str, int]:
    """The loopback address and port of ipv4:HOST:PORT or ipv6:[HOST]:PORT; PermissionDeniedError
    for any other TCP target, saying how to reach that daemon."""
    scheme, _, rest = target.partition(":")
    host, _, port = rest.rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]")) if scheme in ("ipv4", "ipv6") else None
        number = int(port)
    except ValueError:
        ip = None
    if ip is None or not ip.is_loopback:
        raise PermissionDeniedError(
            f"the daemon at {target} cannot prove who it is: over TCP a rank trusts a daemon only through TLS "
            f"({TLS_CA_VARIABLE}=<the PEM of the authority that signed the daemon's tls_cert>) or on a loopback "
            "address, whose listening socket's owner it checks (ipv4:127.0.0.1:PORT, ipv6:[::1]:PORT); or use "
            "the daemon's Unix socket"
        )
    return str(ip), number
