"""What test modules share beyond files, so that none imports another test module.

For tests only (it imports pytest); the pytest fixtures built on it (`kv`, `tier_files`,
`daemon_factory`) are in tests/conftest.py, where pytest finds them for every directory.

- `mount_tier(backing, mountpoint, **options)`: the slow-tier simulator (bench/tiersim)
  for a `with` block, or the test skipped where FUSE cannot be used (a failure where it
  is required: KVPREFETCH_REQUIRE_FUSE=1, as CI sets); `start_tier` for a lifetime no
  `with` fits. `require_fuse()`: the same check without mounting, for a test that mounts
  later or several times.
- `until(check, what)`: poll a state until it holds, failing after a deadline: the wait
  every test uses instead of a sleep that guesses how long the daemon takes.
- `ok(daemon, op, ...)`: one request that must succeed, on a connection patient enough
  for a `wait` on a slow tier; `balanced(reply)`: a success, every accepted file has an
  outcome.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pytest

import tiersim
from kvharness.daemon import Daemon
from kvharness.wire import RawConnection

T = TypeVar("T")
CALL_TIMEOUT_S = 120.0  # a `wait` on the simulator: thousands of fetches of 100 ms


def skip_without_fuse(error: tiersim.FuseUnavailable) -> NoReturn:
    """Skip saying why FUSE cannot be used; re-raise where it must be (CI)."""
    if tiersim.fuse_required():
        raise error
    pytest.skip(str(error))


def require_fuse() -> None:
    """Skip (or fail, where FUSE is required) unless the simulator can be mounted here."""
    try:
        tiersim.check_fuse()
    except tiersim.FuseUnavailable as error:  # pragma: no cover - CI requires FUSE
        skip_without_fuse(error)


def start_tier(backing: str | Path, mountpoint: str | Path, **options: Any) -> tiersim.Tier:
    """The simulator mounted (options: TierOptions' fields) for a lifetime that does not
    fit a `with` block (the caller closes it), or the test skipped (skip_without_fuse)."""
    tier = tiersim.Tier(Path(backing), Path(mountpoint), tiersim.TierOptions(**options))
    try:
        return tier.start()
    except tiersim.FuseUnavailable as error:  # pragma: no cover - CI requires FUSE
        skip_without_fuse(error)


@contextmanager
def mount_tier(backing: str | Path, mountpoint: str | Path,
               **options: Any) -> Iterator[tiersim.Tier]:
    """tiersim.mount for the block, or the test skipped (see skip_without_fuse). Only the
    mount is guarded: a FuseUnavailable raised inside the block is the test's own."""
    with start_tier(backing, mountpoint, **options) as tier:  # unmounts, releasing holds
        yield tier


def until(check: Callable[[], T], what: str | Callable[[], object], timeout: float = 30.0,
          poll: float = 0.02) -> T:
    """Poll `check` until it returns something truthy, and return that; fail after
    `timeout` s (generous: the host is shared) saying `what` never held (a callable
    `what` is called then, to show the state it stopped in)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"not within {timeout:g} s: {said}")
        time.sleep(poll)


def call(daemon: Daemon, op: str, *, timeout: float = CALL_TIMEOUT_S,
         **fields: Any) -> dict[str, Any]:
    """One request on a fresh connection that waits up to `timeout` s for its reply; the
    reply, an error reply too."""
    with RawConnection(daemon.socket_path, timeout) as connection:
        return connection.call(op, **fields)


def ok(daemon: Daemon, op: str, *, timeout: float = CALL_TIMEOUT_S,
       **fields: Any) -> dict[str, Any]:
    """`call`, whose reply must be a success (AssertionError showing it otherwise)."""
    reply = call(daemon, op, timeout=timeout, **fields)
    if reply.get("ok") is not True:
        raise AssertionError(f"{op} refused: {reply!r}")
    return reply


def balanced(reply: dict[str, Any]) -> bool:
    """A success whose books balance: every file accepted has exactly one outcome
    (accepted = read + resident + missing + rejected + failed + expired)."""
    return reply.get("ok") is True and reply["accepted"] == sum(reply["outcomes"].values())
