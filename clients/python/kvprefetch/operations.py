"""The daemon's operations, written once for both clients.

Each public call (ping, prefetch, ...) is a builder: from the caller's arguments it makes the
requests to put on the wire and says how their replies become the result, an Exchange. The
blocking Client and the asyncio AsyncClient inherit the calls from Operations and differ only
in how they carry an exchange (`_perform`: a socket and poll(), or the event loop), so what a
call sends, what it checks and how it reads the reply cannot drift apart between them.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import ssl
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Self, TypeVar, overload

from kvprefetch import protocol, results
from kvprefetch.diagnosis import DoctorReport, parse_doctor
from kvprefetch.protocol import MAX_FRAME_BYTES, PathLike, Reply, default_socket
from kvprefetch.stats import Stats

if TYPE_CHECKING:
    from kvprefetch.aio import AsyncClient
    from kvprefetch.client import Client

P = ParamSpec("P")
T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Exchange(Generic[T]):
    """The requests of one call, sent back to back, and what their replies mean.

    Built before anything is sent, so a bad argument fails before the connection is touched.
    `parse` gets every reply, `ok: false` ones included, in request order: the clients
    collect them all first, leaving the connection clean when it raises the first error.
    """

    requests: list[dict[str, Any]]
    parse: Callable[[list[Reply]], T]

    @staticmethod
    def one(request: Mapping[str, Any], parse: Callable[[Reply], R]) -> Exchange[R]:
        """One request; its reply is checked (ServerError for `ok: false`), then parsed."""
        return Exchange([dict(request)], lambda replies: parse(protocol.check_reply(replies[0])))


class operation(Generic[P, T]):
    """A public call of both clients, defined by its builder.

    The builder is written in Operations' body without `self`: it only turns arguments into
    an Exchange. Each client class gets a real method for it, made once by the class's own
    `_method` (Operations.__init_subclass__): the builder's name, parameters and docstring,
    a plain method on Client, a coroutine method on AsyncClient. For type checkers this
    descriptor says the same through its overloads.
    """

    def __init__(self, build: Callable[P, Exchange[T]]) -> None:
        self.build = build
        self.__doc__ = build.__doc__

    @overload
    def __get__(self, client: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, client: Client, owner: type[Any] | None = None) -> Callable[P, T]: ...
    @overload
    def __get__(
        self, client: AsyncClient, owner: type[Any] | None = None
    ) -> Callable[P, Coroutine[Any, Any, T]]: ...
    def __get__(self, client: Operations | None, owner: type[Any] | None = None) -> Any:
        if client is None:
            return self
        return self.method_for(type(client)).__get__(client)

    def method_for(self, cls: type[Operations]) -> Callable[..., Any]:
        """The method `cls` calls this operation by, shown as the builder with `self`."""
        method = cls._method(self.build)
        functools.update_wrapper(method, self.build)
        method.__qualname__ = f"{cls.__qualname__}.{method.__name__}"
        built = inspect.signature(self.build)
        self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
        vars(method)["__signature__"] = built.replace(
            parameters=[self_parameter, *built.parameters.values()],
            return_annotation=inspect.Signature.empty,
        )
        return method


def _as_is(reply: Reply) -> Reply:
    return reply


class Operations:
    """What both clients share: their settings, request ids, and every public call.

    `socket_path` defaults to the daemon's own choice (protocol.default_socket); it may
    also be `tls://HOST:PORT` (a daemon's TCP listener, mutual TLS: pass `ssl_context`,
    a client context with its certificate and the CA to trust) or `tcp://HOST:PORT`
    (plaintext, which a daemon serves on loopback only, for tests). `timeout`
    (seconds, None for none) bounds connecting, sending and each wait for a reply; a `wait`
    request's own `timeout_ms` is added to it. `max_frame` bounds requests and replies.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        timeout: float | None = 5.0,
        *,
        max_frame: int = MAX_FRAME_BYTES,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.socket_path = os.fspath(socket_path) if socket_path is not None else default_socket()
        self.endpoint = protocol.parse_endpoint(self.socket_path)
        if self.endpoint.kind == "tls" and ssl_context is None:
            raise ValueError(f"{self.socket_path}: a tls:// endpoint needs ssl_context")
        self.ssl_context = ssl_context
        self.timeout = timeout
        self.max_frame = max_frame
        self._ids = itertools.count(1)
        self._init_transport()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Give each client class real methods for the calls (see operation), unless a class
        on the way down defines its own."""
        super().__init_subclass__(**kwargs)
        for name, call in vars(Operations).items():
            if isinstance(call, operation) and inspect.getattr_static(cls, name) is call:
                setattr(cls, name, call.method_for(cls))

    # --- what each client provides ----------------------------------------------------------

    def _init_transport(self) -> None:
        """Set up the client's connection state (no connection is made yet)."""
        raise NotImplementedError

    @staticmethod
    def _method(build: Callable[..., Exchange[Any]]) -> Callable[..., Any]:
        """A method that builds its exchange from the arguments and performs it."""
        raise NotImplementedError

    def _frame(self, request: Mapping[str, Any]) -> tuple[int, bytes]:
        """The next request id, and `request` framed with its envelope."""
        request_id = next(self._ids)
        frame = protocol.encode_frame(protocol.stamp(request, request_id), self.max_frame)
        return request_id, frame

    # --- the calls ----------------------------------------------------------------------------

    @operation
    def call(request: Mapping[str, Any]) -> Exchange[Reply]:
        """Send one request (a map with `op`; the client adds `v` and `id`) and return its
        successful reply (ServerError otherwise)."""
        return Exchange.one(request, _as_is)

    @operation
    def ping() -> Exchange[results.PingResult]:
        """The daemon's version, protocol, engine and worker count."""
        return Exchange.one(protocol.ping_request(), results.parse_ping)

    @operation
    def prefetch(
        paths: Iterable[PathLike],
        *,
        wait: bool = False,
        read_bytes: int | None = None,
        timeout_ms: int | None = None,
        deadline: float | None = None,
        max_failures: int | None = None,
    ) -> Exchange[results.PrefetchResult]:
        """Warm the heads of `paths`: counts at once, or with `wait` the outcomes too.

        `deadline`: seconds from now after which a file not yet issued is not read (it is
        `expired`); `failures` in the result say which files were not warmed and why."""
        request = protocol.prefetch_request(
            paths, wait=wait, read_bytes=read_bytes, timeout_ms=timeout_ms, deadline=deadline,
            max_failures=max_failures,
        )
        return Exchange.one(request, results.parse_prefetch)

    @operation
    def prefetch_many(
        batches: Iterable[Iterable[PathLike]],
        *,
        wait: bool = False,
        read_bytes: int | None = None,
        timeout_ms: int | None = None,
        deadline: float | None = None,
        max_failures: int | None = None,
    ) -> Exchange[list[results.PrefetchResult]]:
        """Pipeline one prefetch per batch and return their results in batch order.

        All requests are on the wire before the first reply is awaited, so with `wait` the
        daemon works on them together: keep the batches within its queues (`room` in an
        ack says how many files they take now), or files are dropped. Every reply is
        collected before the first ServerError is raised, leaving the connection clean.
        """
        requests = [
            protocol.prefetch_request(b, wait=wait, read_bytes=read_bytes, timeout_ms=timeout_ms,
                                      deadline=deadline, max_failures=max_failures)
            for b in batches
        ]
        return Exchange(requests, lambda replies: [_checked_prefetch(reply) for reply in replies])

    @operation
    def prefetch_blocks(
        *,
        wait: bool = False,
        read_bytes: int | None = None,
        timeout_ms: int | None = None,
        deadline: float | None = None,
        max_failures: int | None = None,
        **kv_request: Any,
    ) -> Exchange[results.PrefetchResult]:
        """Warm the files a KV request (model or hash+layout, then prompts or block_hashes)
        maps to; the daemon does the hashing and path layout."""
        request = protocol.prefetch_blocks_request(
            kv_request, wait=wait, read_bytes=read_bytes, timeout_ms=timeout_ms,
            deadline=deadline, max_failures=max_failures,
        )
        return Exchange.one(request, results.parse_prefetch)

    @operation
    def check(
        paths: Iterable[PathLike],
        *,
        read_bytes: int | None = None,
        details: bool = False,
        timeout_ms: int | None = None,
    ) -> Exchange[results.CheckResult]:
        """Residency of `paths` by their roots' rules, without reading them or changing
        their atime; `details` adds each file's figures."""
        request = protocol.inspect_request("check", paths, read_bytes=read_bytes,
                                           details=details, timeout_ms=timeout_ms)
        return Exchange.one(request, results.parse_check)

    @operation
    def evict(
        paths: Iterable[PathLike],
        *,
        whole: bool = False,
        read_bytes: int | None = None,
        details: bool = False,
        timeout_ms: int | None = None,
    ) -> Exchange[results.CheckResult]:
        """Drop the heads (`whole`: the whole files) of `paths` from the page cache; the
        daemon refuses (ServerError, forbidden) unless it runs with allow_evict."""
        request = protocol.inspect_request("evict", paths, read_bytes=read_bytes,
                                           details=details, timeout_ms=timeout_ms, whole=whole)
        return Exchange.one(request, results.parse_check)

    @operation
    def resolve(**kv_request: Any) -> Exchange[results.ResolveResult]:
        """The block hashes and file paths a KV request maps to, without any I/O."""
        return Exchange.one(protocol.resolve_request(kv_request), results.parse_resolve)

    @operation
    def stats() -> Exchange[Stats]:
        """The daemon's counters and gauges (kvprefetch.stats describes them)."""
        return Exchange.one(protocol.stats_request(), results.parse_stats)

    @operation
    def doctor() -> Exchange[DoctorReport]:
        """Per root: its file system, tier profile, FUSE limits, and what stands in the way
        of warming it, each problem with its fix (kvprefetch.diagnosis describes it)."""
        return Exchange.one({"op": "doctor"}, parse_doctor)


def _checked_prefetch(reply: Reply) -> results.PrefetchResult:
    return results.parse_prefetch(protocol.check_reply(reply))
