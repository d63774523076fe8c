"""Where the daemon listens: the default socket chain and the parsers of listen addresses.

Apart from config.py so that the one chain the clients mirror (clients/python's
protocol.default_socket, clients/go's DefaultSocket; all three held to the cases of
clients/go/testdata/default_socket.json) and the address grammar can be read, and tested,
on their own.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

SOCKET_ENV = "KVPREFETCHD_SOCKET"
# Where the shipped units put the socket (kvprefetchd.socket, RuntimeDirectory=kvprefetchd).
SYSTEMD_SOCKET = "/run/kvprefetchd/kvprefetchd.sock"
SOCKET_NAME = "kvprefetchd.sock"
# The runtime directories looked at, in order: systemd's for the service, then the user's.
RUNTIME_DIRS = ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR")
FALLBACK_SOCKET = "/tmp/kvprefetchd.sock"

SOCKET_CHAIN = (
    f"${SOCKET_ENV} if set; else {SYSTEMD_SOCKET} if it exists (a daemon under the "
    "shipped systemd units); else kvprefetchd.sock in $RUNTIME_DIRECTORY, then in "
    "$XDG_RUNTIME_DIR (the first entry before any ':', when it is an absolute path); "
    f"else {FALLBACK_SOCKET}"
)


def default_socket_path(systemd_socket: str = SYSTEMD_SOCKET) -> str:
    """The socket when nobody names one (SOCKET_CHAIN), so that a daemon and a client
    started with no flags find each other without root-only paths.

    The systemd path comes before the runtime directories because a client run from
    another service has a RUNTIME_DIRECTORY of its own; a daemon started by hand beside
    a systemd one is refused on the socket in use instead of hiding in another place.
    Relative runtime directories are ignored, as the XDG base directory spec says."""
    explicit = os.environ.get(SOCKET_ENV)
    if explicit:
        return explicit
    if os.path.exists(systemd_socket):
        return systemd_socket
    for env in RUNTIME_DIRS:
        base = os.environ.get(env, "").split(":")[0]
        if base.startswith("/"):
            return os.path.join(base, SOCKET_NAME)
    return FALLBACK_SOCKET


def split_host_port(address: str) -> tuple[str, int]:
    """HOST:PORT or [IPV6]:PORT (listen_tcp)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


# ---- the metrics address -------------------------------------------------------------------


class MetricsAddressError(ValueError):
    """The `metrics` setting is not "HOST:PORT", "[IPV6]:PORT" or "unix:/PATH"."""


@dataclass(frozen=True)
class MetricsAddress:
    family: socket.AddressFamily
    host: str = ""  # an IP literal (TCP)
    port: int = 0
    path: str = ""  # AF_UNIX

    def __str__(self) -> str:
        if self.family == socket.AF_UNIX:
            return f"unix:{self.path}"
        if self.family == socket.AF_INET6:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"


_FORMS = '"127.0.0.1:9464", "[::1]:9464" or "unix:/run/kvprefetchd/metrics.sock"'


def parse_metrics_address(text: str) -> MetricsAddress:
    """Parse (and validate, without binding) the `metrics` setting.

    Only IP literals (and "localhost", meaning 127.0.0.1): resolving a name at
    start would make the listening address depend on DNS.
    """
    if not isinstance(text, str) or not text:
        raise MetricsAddressError(f"metrics: expected {_FORMS}")
    if text.startswith(("unix:", "/")):
        path = text.removeprefix("unix:")
        if not path.startswith("/"):
            raise MetricsAddressError(f"metrics: {text!r}: a Unix socket path must be absolute")
        if len(os.fsencode(path)) > 107:  # sun_path is 108 bytes with its NUL
            raise MetricsAddressError(f"metrics: {text!r}: path longer than 107 bytes")
        return MetricsAddress(socket.AF_UNIX, path=path)
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep:
            raise MetricsAddressError(f"metrics: {text!r}: expected {_FORMS}")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise MetricsAddressError(
                f"metrics: {text!r}: expected {_FORMS} (say 0.0.0.0:PORT for every interface)"
            )
        if ":" in host:
            raise MetricsAddressError(f"metrics: {text!r}: write an IPv6 address in brackets")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise MetricsAddressError(f"metrics: {text!r}: {host!r} is not an IP address") from None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise MetricsAddressError(f"metrics: {text!r}: {port_text!r} is not a port number")
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    return MetricsAddress(family, host=str(ip), port=int(port_text))
