"""A worker as a process: what runs in the forked child before and after its loop.

The child drops the supervisor's fds and signal handlers, names itself, renices and
goes SCHED_BATCH, pins glibc's malloc behaviour, builds its engines (or says why it
cannot: BootFailed, and EXIT_BOOT_FAILED), reports Ready and runs the Worker's loop
(loop.py) until the supervisor goes away.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import resource
import signal
import socket
import sys
from typing import NoReturn

from kvprefetchd.channel import BootFailed, Ready, close_other_fds
from kvprefetchd.engines import WarmEngines
from kvprefetchd.faults import WORKER_BOOT_FAILS, injected
from kvprefetchd.worker.loop import Worker
from kvprefetchd.worker.plan import WorkerPlan
from kvprefetchd.worker.report import send_all_blocking

log = logging.getLogger("kvprefetchd.worker")

# Named exit codes, so the supervisor can tell a worker that cannot boot (halt
# the daemon: respawning would fail the same way forever) from one that died.
EXIT_OK = 0
EXIT_BOOT_FAILED = 3

# mallopt(3) parameter numbers, from glibc's <malloc.h>.
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own initial value
# The queue's threads allocate little (a record per file comes and goes on the worker's
# own thread): a few arenas serve them. Set explicitly, glibc also stops reading
# /sys/devices/system/cpu/online the first time a new thread allocates (arena.c sizes
# its default limit from the CPU count), which the path audits would count as a file
# opened outside the roots.
ARENA_MAX = 4


def pin_mmap_threshold() -> None:
    """Keep buffers of 128 KiB and more out of the brk heap, where they fragment it (and
    bound the arenas: ARENA_MAX).

    glibc raises its mmap threshold to the size of every mmapped chunk it frees
    (mallopt(3), M_MMAP_THRESHOLD), so once the first 1 MiB recv buffer is freed,
    later big buffers (recv, channel frames, msgpack arrays of a batch) come from the
    heap, and small long-lived blocks between them keep it from shrinking. Measured
    with bench/soak.py (8 clients, 10^6 requests, ~26M files): a worker's [heap] grew
    4.2 -> 12-14 MiB and its RSS drifted +11% after warm-up, still climbing over
    3x10^6 requests; with the threshold set, [heap] 4.2 -> 4.5 MiB and RSS drift +0.4-1%.
    Setting it explicitly also turns the dynamic adjustment off. Not glibc: a no-op.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    mallopt(M_ARENA_MAX, ARENA_MAX)


def fd_room(wanted: int) -> None:
    """Raise the soft RLIMIT_NOFILE towards `wanted` (at most the hard limit): a worker holds
    an fd per read in flight, per batch file open, and per file held open for its consumer
    (holds.py), more than the supervisor's own need it inherited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def worker_main(plan: WorkerPlan, sock: socket.socket) -> NoReturn:
    """Entry point in the forked child; never returns into the supervisor's code."""
    status = EXIT_OK
    try:
        close_other_fds({0, 1, 2, sock.fileno(), *(fd for fd in plan.root_fds if fd >= 0)})
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        try:
            import setproctitle

            setproctitle.setproctitle(f"kvprefetchd: worker {plan.index}")
        except ImportError:
            pass
        sock.setblocking(False)
        renice = ""
        if plan.nice:
            try:
                os.nice(plan.nice)
            except OSError as error:
                # A seccomp filter (systemd's ~@resources) or a container may forbid
                # setpriority: the worker serves at the supervisor's priority, said once.
                renice = f"cannot renice workers by {plan.nice}: {error.strerror}"
        if plan.batch:
            try:
                # No wake-up preemption (sched(7)): the ack's client and the supervisor run
                # first. Threads made later (the queue engine's) inherit it.
                os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            except OSError as error:
                renice = "; ".join(filter(None, (
                    renice, f"cannot set SCHED_BATCH on workers: {error.strerror}")))
        pin_mmap_threshold()
        settings = plan.engine_settings
        fd_room(settings.max_open_files + settings.max_in_flight + plan.holds.max_files + 64)
        try:
            if injected(WORKER_BOOT_FAILS):
                raise RuntimeError("boot failure injected by KVPREFETCHD_FAULTS")
            engines = WarmEngines(plan.engines, plan.warm_mode, plan.engine_settings,
                                  f"worker {plan.index}")
            engine = engines.default
        except Exception as error:
            send_all_blocking(sock, BootFailed(f"{type(error).__name__}: {error}"))
            os._exit(EXIT_BOOT_FAILED)
        send_all_blocking(sock, Ready(engine.name, os.getpid(), renice))
        Worker(plan, sock, engines).run()
    except BaseException:
        log.exception("worker %d crashed", plan.index)
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)
