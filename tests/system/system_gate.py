"""When the system test runs, and what an inability to run means.

It boots containers and takes minutes, so it runs only when asked: `./dev test-system`
sets KVPREFETCH_SYSTEM=1, and `./dev test` (every test directory) skips it, in one line.
Where it cannot run it skips with the reason, unless KVPREFETCH_REQUIRE_SYSTEM=1 (CI)
makes that a failure.
"""

from __future__ import annotations

import os

import pytest

ENABLE_ENV = "KVPREFETCH_SYSTEM"
REQUIRE_ENV = "KVPREFETCH_REQUIRE_SYSTEM"
NOT_ASKED = f"the system test runs under ./dev test-system ({ENABLE_ENV}=1)"


def required() -> bool:
    return os.environ.get(REQUIRE_ENV) == "1"


def asked() -> bool:
    return os.environ.get(ENABLE_ENV) == "1" or required()


def unavailable(reason: str) -> None:
    """Skip, or fail when the run was required to happen."""
    if required():
        pytest.fail(f"{REQUIRE_ENV}=1 but the system test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)
