"""What can go wrong when talking to kvprefetchd.

Everything derives from KVPrefetchError so a caller that only wants "the warm-up did not
happen" catches one class; the subclasses exist because the right reaction differs: retry
later (ConnectFailed, ConnectionClosed, Timeout), fix the request (ServerError bad_request),
or report a bug (ProtocolError).
"""

from __future__ import annotations

__all__ = [
    "ConnectFailed",
    "ConnectionClosed",
    "KVPrefetchError",
    "ProtocolError",
    "ServerError",
    "Timeout",
]


class KVPrefetchError(Exception):
    """Base of every error this package raises on purpose."""


class ServerError(KVPrefetchError):
    """The daemon answered `ok: false`.

    `code` stays a plain string rather than an ErrorCode so a newer daemon's new codes still
    reach the caller instead of failing inside the client.
    """

    def __init__(self, code: str, message: str, request_id: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class ConnectFailed(KVPrefetchError):
    """No connection could be made; kept apart from ConnectionClosed because it means the
    daemon is absent or the path is wrong, which callers (and the CLI's exit code) treat
    differently from a daemon that went away mid-call."""

    def __init__(self, socket_path: str, cause: OSError) -> None:
        reason = cause.strerror or str(cause)
        super().__init__(f"cannot connect to kvprefetchd at {socket_path}: {reason}")
        self.socket_path = socket_path


class ConnectionClosed(KVPrefetchError):
    """The connection broke during a call (daemon restarted or died).

    The call's fate is unknown; the client reconnects on the next call, so retrying is the
    caller's choice.
    """


class Timeout(KVPrefetchError):
    """No reply in time. The request may still be served; its late reply is discarded."""


class ProtocolError(KVPrefetchError):
    """The bytes on the wire broke the framing or the reply schema of protocol.md."""
