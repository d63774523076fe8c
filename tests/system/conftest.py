"""The system test's fixtures: a Debian 12 container booted with systemd, kvprefetchd installed.

Runs only when asked, and skips or fails where it cannot run (system_gate.py): it needs
root, debootstrap and systemd-nspawn, and takes minutes.

One container per session (booting and installing take ~10 s); each test starts from the
installed state (`Service.reset()`). The container is torn down on every way out: the
fixture's finalizer, SIGTERM and SIGHUP turned into KeyboardInterrupt (so pytest's
teardown runs as on Ctrl-C), and atexit as the last resort. A run killed with SIGKILL
leaves its container to the next run, which reaps it (system_container.reap_stale).
"""

from __future__ import annotations

import atexit
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from system_container import (
    Container,
    ContainerUnavailable,
    cgroup_hierarchies,
    nspawn_problem,
    reap_stale,
)
from system_gate import NOT_ASKED, asked, unavailable
from system_install import WheelsUnavailable, chosen_installation
from system_rootfs import RootfsUnavailable, ensure_rootfs
from system_service import FIGURES, MEMBER, OUTSIDER, SOCKET_UNIT, Service

# Figures for the summary at the end of the run (pytest_terminal_summary).
TIMINGS: dict[str, str] = {}


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


@pytest.fixture(scope="session")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    if not asked():
        pytest.skip(NOT_ASKED)
    problem = nspawn_problem()
    if problem:
        unavailable(problem)
    work = tmp_path_factory.mktemp("system")
    reaped = reap_stale(cgroup_hierarchies())
    if reaped:
        TIMINGS["reaped containers of killed runs"] = ", ".join(reaped)
    try:
        rootfs = ensure_rootfs(work / "debootstrap.log")
    except RootfsUnavailable as error:
        unavailable(str(error))
        raise  # unreachable: unavailable() skips or fails
    TIMINGS["rootfs"] = (f"{'built' if rootfs.built else 'cached'} in {rootfs.seconds:.1f} s: "
                         f"{rootfs.path}")

    started = time.monotonic()
    installation = chosen_installation()
    try:
        installation.prepare(work)
    except WheelsUnavailable as error:
        unavailable(str(error))
    TIMINGS["prepare on the host"] = f"{time.monotonic() - started:.1f} s"

    container = Container(rootfs.path, work / "console.log")
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    atexit.register(container.shutdown)
    try:
        try:
            container.boot()
        except ContainerUnavailable as error:
            unavailable(str(error))
        TIMINGS["boot"] = f"{container.boot_seconds:.1f} s (machine {container.name})"
        installed = installation.install(container)
        TIMINGS["install"] = f"{installed.seconds:.1f} s: {installed.method}"
        started = time.monotonic()
        # README: "systemctl daemon-reload && systemctl enable --now kvprefetchd.socket",
        # and routers join the socket's group.
        container.run(["systemctl", "daemon-reload"])
        container.run(["systemctl", "enable", "--now", SOCKET_UNIT])
        container.run(["useradd", "--create-home", "--groups", "kvprefetchd", MEMBER])
        container.run(["useradd", "--create-home", OUTSIDER])
        TIMINGS["enable"] = f"{time.monotonic() - started:.1f} s"
        yield Service(container, installed)
    finally:
        started = time.monotonic()
        forced = container.shutdown()
        atexit.unregister(container.shutdown)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        TIMINGS["teardown"] = (f"{time.monotonic() - started:.1f} s"
                               + (f" ({'; '.join(forced)})" if forced else ""))
        left = [h.mount / container.name for h in container.hierarchies
                if (h.mount / container.name).exists()]
        assert not left, f"cgroups left behind: {left}"


@pytest.fixture
def service(system: Service) -> Service:
    """The installed units, reset: socket listening, service stopped, shipped config."""
    system.reset()
    return system


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not TIMINGS and not FIGURES:
        return
    terminalreporter.section("system test: figures")
    for what, figure in {**TIMINGS, **FIGURES}.items():
        terminalreporter.write_line(f"{what}: {figure}")

