"""Residency as an unprivileged non-owner: never a false RESIDENT.

For a file the caller neither owns nor may write, mincore claims every page
resident (Linux 5.2+, commit 134fca9063ad) and cachestat refuses with EPERM
(6.14+, commit 5f537664e705).  The extension must answer -EPERM rather than
the lie, and the PAGECACHE rule must then warm.  The check runs in a forked
child that drops to nobody; descriptors are opened by root and inherited.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest
from native_helpers import Batch, Ctx, MiB, as_nobody, write_file

from kvharness.pagecache import pinned
from kvprefetchd._native import lib


def test_non_owner_never_sees_a_false_resident(root) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to nobody")
    path = write_file(root.path / "f", 2 * MiB)
    os.chmod(path, 0o644)  # readable, not writable, by nobody
    fd = os.open(path, os.O_RDONLY)
    try:
        batch = Batch(root.fd, ["f"], MiB, residency=lib.KVP_RES_PAGECACHE)
        ctx = Ctx("pread-read")

        def child() -> dict[str, Any]:
            return {
                "cachestat": lib.kvp_resident_bytes(fd, 0, 2 * MiB, 0),
                "mincore": lib.kvp_resident_bytes(fd, 0, 2 * MiB, 1),
                "outcome": ctx.run_batch(batch)[0].outcome,
            }

        # Fully cached and mlocked while the child looks: the truthful answer is "all
        # resident", whatever the host's reclaimer does meanwhile.
        with pinned([path]) as pin:
            pin.require_all()
            got = as_nobody(child)
    finally:
        os.close(fd)
    # mincore would say 2 MiB whatever the truth: refused
    assert got["mincore"] == -errno.EPERM
    if got["cachestat"] == -errno.EPERM:  # 6.14+: cachestat refuses too, so warm
        assert got["outcome"] == "READ"
    else:  # an older cachestat tells the truth to anyone
        assert got["cachestat"] == 2 * MiB
        assert got["outcome"] == "RESIDENT"
