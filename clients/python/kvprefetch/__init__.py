"""Client for kvprefetchd, speaking only its wire protocol (never importing the daemon), so
it stays honest about the contract in docs/protocol.md."""

__version__ = "0.11.0"  # released with kvprefetchd of the same version

from kvprefetch.aio import AsyncClient
from kvprefetch.client import Client
from kvprefetch.errors import (
    ConnectFailed,
    ConnectionClosed,
    KVPrefetchError,
    ProtocolError,
    ServerError,
    Timeout,
)
from kvprefetch.protocol import DEFAULT_SOCKET, PROTOCOL_VERSION, ErrorCode, Outcome
from kvprefetch.results import (
    CheckResult,
    Failure,
    FileState,
    PingResult,
    PrefetchResult,
    ResolveResult,
)

__all__ = [
    "DEFAULT_SOCKET",
    "PROTOCOL_VERSION",
    "AsyncClient",
    "CheckResult",
    "Client",
    "ConnectFailed",
    "ConnectionClosed",
    "ErrorCode",
    "Failure",
    "FileState",
    "KVPrefetchError",
    "Outcome",
    "PingResult",
    "PrefetchResult",
    "ProtocolError",
    "ResolveResult",
    "ServerError",
    "Timeout",
]
