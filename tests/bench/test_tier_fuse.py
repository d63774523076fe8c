"""Where FUSE cannot be used, the suite's slow tier says why and goes on; under
KVPREFETCH_REQUIRE_FUSE=1 (CI, where /dev/fuse exists) that is a failure instead.

FUSE is made unusable the way it is on a developer's laptop: not root (the simulator mounts
with allow_other). As root the check runs in a forked child that drops to nobody first.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import suite
import tier

import tiersim

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux only")


def as_nobody(call: Callable[[], str]) -> str:
    """call() without root: in a child that gave it up (as root), else here."""
    if os.geteuid() != 0:
        return call()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        message = "no answer"
        try:
            os.setgid(65534)
            os.setuid(65534)
            message = call()
        except BaseException as exc:  # the parent reads whatever happened
            message = f"raised {type(exc).__name__}: {exc}"
        finally:
            os.write(write_end, message.encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        message = reader.read().decode()
    os.waitpid(pid, 0)
    return message


def tier_status(tmp_path: Path, require: bool) -> str:
    """What the suite's tier runner makes of an unusable FUSE, with or without the rule."""
    args = tier.parse_args(tier.table_argv({"dataset": "10x512KiB", "latency_ms": 5}, 1,
                                           tmp_path / "data", tmp_path / "out"))
    saved = os.environ.pop(tiersim.REQUIRE_ENV, None)  # restored: this may run in-process
    if require:
        os.environ[tiersim.REQUIRE_ENV] = "1"
    try:
        run = suite._tier_runner("tier/test", args, tmp_path / "raw")
        return str(run(suite.Progress(1))["status"])
    finally:
        os.environ.pop(tiersim.REQUIRE_ENV, None)
        if saved is not None:
            os.environ[tiersim.REQUIRE_ENV] = saved


def test_an_unusable_fuse_skips_the_tier_with_the_reason(tmp_path: Path) -> None:
    status = as_nobody(lambda: tier_status(tmp_path, require=False))
    assert status.startswith("skipped: ") and "root" in status, status
    assert not (tmp_path / "data").exists()  # refused before any dataset was written


def test_an_unusable_fuse_fails_where_it_is_required(tmp_path: Path) -> None:
    message = as_nobody(lambda: tier_status(tmp_path, require=True))
    assert message.startswith("raised FuseUnavailable: ") and "root" in message, message
