"""A slow storage tier to run warmers, the daemon and its tests against.

    import tiersim   # with bench/ on sys.path

    with tiersim.mount(backing, mountpoint, latency_ms=100, chunk_bytes=1 << 20) as tier:
        tier.evict_all()                       # every file cold again
        ...                                    # warm, read, stat through `mountpoint`
        print(tier.stats().fetches, tier.stats().peak_in_flight)
        with tier.hang("read", "/model_a/"):   # reads under /model_a/ block until the block ends
            ...

The simulator is C on libfuse3 (tiersim.c and its modules, README.md): built from source on
first use, mounted over `backing`, driven through a Unix socket outside the mount.  Leaving
the `with` block always unmounts, releasing every held request first, so no reader is left
blocked in the kernel.  Where FUSE cannot be used, `mount` raises FuseUnavailable, which
tests turn into a skip unless KVPREFETCH_REQUIRE_FUSE=1.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from ._build import BuildError, build
from ._system import (
    REQUIRE_ENV,
    FuseUnavailable,
    abort_connection,
    bdi_file,
    check_fuse,
    fuse_required,
    lazy_unmount,
    mount_device,
    read_connection,
)

__all__ = ["REQUIRE_ENV", "BuildError", "FuseUnavailable", "HangKind", "Tier", "TierError",
           "TierOptions", "TierStats", "build", "check_fuse", "fuse_required", "mount",
           "mount_device"]

HangKind = Literal["read", "readdir", "stat", "all"]
EXIT_CANNOT_MOUNT = 3  # tiersim.c: the mount itself failed
READY_TIMEOUT = 30.0
EXIT_TIMEOUT = 10.0


class TierError(RuntimeError):
    """The simulator refused a command or failed: a bug in the caller or the simulator."""


@dataclass(frozen=True)
class TierOptions:
    """How the tier behaves; the first four can also change while mounted (`Tier.set`)."""

    latency_ms: float = 0.0       # first read of a chunk waits this long (a fetch)
    jitter_ms: float = 0.0        # plus uniform(0, jitter_ms) per fetch
    slots: int = 0                # fetches in flight at most (AFM gateway threads); 0: no cap
    bandwidth: int = 0            # bytes/s over all fetches; 0: no cap
    chunk_bytes: int = 1 << 20    # the fetch unit
    max_background: int = 1024    # background requests in flight; 0: the kernel's 12
    congestion_threshold: int = 0  # 0: 3/4 of max_background, the kernel's ratio
    max_readahead: int = 0        # 0: what the kernel offers (its bdi's read_ahead_kb)
    read_ahead_kb: int | None = None  # written to the mount's bdi after mounting, if set
    fuse_threads: int = 8
    reply_threads: int = 4
    entry_timeout: float = 1.0
    attr_timeout: float = 1.0
    splice: bool = True
    clone_fd: bool = False
    subtype: str = "tiersim"      # the mount's type is fuse.<subtype>
    seed: int = 1

    def argv(self) -> list[str]:
        args = ["--latency-ms", str(self.latency_ms), "--jitter-ms", str(self.jitter_ms),
                "--slots", str(self.slots), "--bandwidth", str(self.bandwidth),
                "--chunk-bytes", str(self.chunk_bytes),
                "--max-background", str(self.max_background),
                "--congestion-threshold", str(self.congestion_threshold),
                "--max-readahead", str(self.max_readahead),
                "--threads", str(self.fuse_threads), "--reply-threads", str(self.reply_threads),
                "--entry-timeout", str(self.entry_timeout),
                "--attr-timeout", str(self.attr_timeout),
                "--subtype", self.subtype, "--seed", str(self.seed)]
        return [*args, *(["--no-splice"] if not self.splice else []),
                *(["--clone-fd"] if self.clone_fd else [])]


@dataclass(frozen=True)
class TierStats:
    """The simulator's counters (`stats`); gauges say what is true now."""

    fetches: int              # completed fetches (chunks brought near)
    fetched_bytes: int
    reads: int                # READ replies with data
    read_bytes: int
    read_errors: int
    in_flight: int            # gauge: fetches holding a slot
    peak_in_flight: int
    queued: int               # gauge: fetches waiting for a slot
    pending_reads: int        # gauge: READs waiting for their fetches
    held: int                 # gauge: requests held by hangs, all kinds
    held_read: int
    held_readdir: int
    held_stat: int
    held_total: int
    evictions: int            # files whose fetched chunks were forgotten
    evicted_chunks: int
    lookups: int
    getattrs: int
    opens: int
    readdirs: int
    files_known: int
    latency_ms: float
    jitter_ms: float
    slots: int
    bandwidth: int
    chunk_bytes: int
    max_background: int       # as asked in INIT; 0: the kernel's default (12)
    congestion_threshold: int
    max_readahead: int
    kernel_max_readahead: int
    splice: bool
    fuse_threads: int
    reply_threads: int
    initialized: bool         # the kernel's INIT was answered

    @classmethod
    def from_reply(cls, reply: dict[str, Any]) -> TierStats:
        return cls(**{f.name: reply[f.name] for f in fields(cls)})


class Tier:
    """A mounted simulator: its control commands, counters and kernel-side knobs.

    Use `mount()` (a context manager); `Tier(...).start()` and `close()` are for lifetimes
    that do not fit a `with` block.
    """

    def __init__(self, backing: Path, mountpoint: Path, options: TierOptions,
                 binary: Path | None = None) -> None:
        self.backing = Path(backing).resolve()
        self.mountpoint = Path(mountpoint).absolute()
        self.options = options
        self._binary = binary
        self._dir = Path(tempfile.mkdtemp(prefix="tiersim-"))  # 0700: the control socket
        self.control_path = self._dir / "control.sock"
        self.log_path = self._dir / "tiersim.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.device = ""  # major:minor of the mount, once mounted
        self._closed = False

    # -- lifetime ---------------------------------------------------------------------

    def start(self) -> Tier:
        """Build if needed, mount, and wait until the simulator serves and listens.

        The simulator unmounts and exits when the thread that started it ends (it is told
        this process's pid; prctl PR_SET_PDEATHSIG follows the forking thread), so a caller
        that dies without closing leaves no mount: start it from a thread that outlives it.
        """
        try:
            binary = self._binary or build()
            self.mountpoint.mkdir(parents=True, exist_ok=True)
            if mount_device(self.mountpoint) is not None:
                raise TierError(f"{self.mountpoint} is already a mount point")
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(
                    [str(binary), "--backing", str(self.backing), "--mount", str(self.mountpoint),
                     "--control", str(self.control_path), "--parent-pid", str(os.getpid()),
                     *self.options.argv()],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                    start_new_session=True)  # a ^C meant for the caller must not end it first
            self._wait_ready()
            device = mount_device(self.mountpoint, f"fuse.{self.options.subtype}")
            if device is None:
                raise TierError(f"the simulator said ready but {self.mountpoint} is not mounted")
            self.device = device
            if self.options.read_ahead_kb is not None:
                bdi_file(device, "read_ahead_kb").write_text(str(self.options.read_ahead_kb))
        except BaseException:
            self.close()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], READY_TIMEOUT)
        line = self.process.stdout.readline() if ready else b""
        if line.strip() == b"ready":
            self._wait_init()
            return
        try:
            code = self.process.wait(EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            code = None
        detail = f"exit status {code}; log:\n{self.log_tail()}"
        if code == EXIT_CANNOT_MOUNT:
            raise FuseUnavailable(f"the FUSE simulator cannot mount here ({detail})")
        raise TierError(f"the simulator did not start ({detail})")

    def _wait_init(self) -> None:
        """Wait for the kernel's INIT to be answered (the loop starts after "ready"), so the
        raised max_background is in force before anyone reads; polled over the control
        socket rather than by touching the mount, which would block if INIT never came."""
        deadline = time.monotonic() + READY_TIMEOUT
        while not self.stats().initialized:
            if time.monotonic() > deadline:
                raise TierError(f"no FUSE INIT within {READY_TIMEOUT} s; log:\n{self.log_tail()}")
            time.sleep(0.005)
        # The simulator has answered INIT; the kernel applies the answer before it lets any
        # request through (fs/fuse/inode.c process_init_reply, then blocked_waitq), so one
        # stat of the root returns once the raised limits are in force.
        os.stat(self.mountpoint)

    def log_tail(self, lines: int = 30) -> str:
        """The end of the simulator's stderr: what it said about INIT, errors, shutdown."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self, timeout: float = EXIT_TIMEOUT) -> None:
        """Unmount and stop, whatever state it is in; idempotent.

        Held requests are released first, then SIGTERM: the simulator answers everything
        still waiting (EIO) and unmounts lazily.  If it has not exited within `timeout`, the
        connection is aborted through fusectl (failing every request, so no reader stays
        blocked) and the process killed; a mount still left is detached.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self.process is not None and self.process.poll() is None:
                with suppress(OSError, TierError, ValueError):
                    self.command("release all", timeout=min(2.0, timeout))
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    if self.device:
                        abort_connection(self.device)
                    self.process.kill()
                    self.process.wait(EXIT_TIMEOUT)
        finally:
            if self.process is not None and self.process.stdout is not None:
                self.process.stdout.close()
            if self.device and mount_device(self.mountpoint) == self.device:
                lazy_unmount(self.mountpoint)
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- control ----------------------------------------------------------------------

    def command(self, line: str, timeout: float = 30.0) -> dict[str, Any]:
        """Send one control command; its JSON reply, or TierError if it was refused."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(self.control_path))
            sock.sendall(line.encode("utf-8", "surrogateescape") + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    raise TierError(f"{line!r}: the simulator closed the connection")
                data += chunk
        reply: dict[str, Any] = json.loads(data)
        if not reply.get("ok"):
            raise TierError(f"{line!r}: {reply.get('error')}")
        return reply

    def tier_path(self, path: str | os.PathLike[str]) -> str:
        """A path as the simulator names it, "/" first from the mount's root.

        Paths inside the mount point are translated; others are taken as already relative
        to the mount's root ("/model_a/" stays "/model_a/").
        """
        text = os.fspath(path)
        root = str(self.mountpoint)
        if text == root or text.startswith(root + "/"):
            text = text[len(root):] or "/"
        return text if text.startswith("/") else "/" + text

    def stats(self) -> TierStats:
        return TierStats.from_reply(self.command("stats"))

    def reset_stats(self) -> None:
        """Zero the counters (the peak becomes what is in flight now): one per measurement."""
        self.command("reset-stats")

    def evict(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Make a file (or every known file under a directory) cold: forget its fetched
        chunks and drop its pages from the kernel's cache.  A file under a read hang keeps
        its pages (counted in `pages_kept_hung`): dropping them would wait for the held
        READs' page locks."""
        return self.command(f"evict {self.tier_path(path)}")

    def evict_all(self) -> dict[str, Any]:
        """Every file of the mount cold again, as after a remount, without remounting."""
        return self.command("evict-all")

    def set(self, *, latency_ms: float | None = None, jitter_ms: float | None = None,
            slots: int | None = None, bandwidth: int | None = None) -> None:
        """Change the tier while mounted; fetches already started keep their timing."""
        for key, value in (("latency_ms", latency_ms), ("jitter_ms", jitter_ms),
                           ("slots", slots), ("bandwidth", bandwidth)):
            if value is not None:
                self.command(f"set {key} {value}")

    def hold(self, kind: HangKind, prefix: str) -> None:
        """From now on, hold (never answer) requests of `kind` under `prefix` until released.

        read: READ; readdir: OPENDIR and READDIR; stat: LOOKUP and GETATTR (the kernel's
        cached attributes under the prefix are dropped, so the next stat asks); all: each.
        Pages already in the page cache are still served by the kernel: evict first to make
        reads of warm files hang too.
        """
        self.command(f"hang {kind} {self.tier_path(prefix)}")

    def release(self, kind: HangKind | None = None, prefix: str | None = None) -> int:
        """End one hang (kind and prefix) or every hang (no arguments); held requests are
        replayed as if they had just arrived.  Returns how many were released."""
        if kind is None and prefix is None:
            return int(self.command("release all")["released"])
        if kind is None or prefix is None:
            raise ValueError("release needs both kind and prefix, or neither")
        return int(self.command(f"release {kind} {self.tier_path(prefix)}")["released"])

    @contextmanager
    def hang(self, kind: HangKind, prefix: str) -> Iterator[Tier]:
        """Hold requests of `kind` under `prefix` for the duration of the block."""
        self.hold(kind, prefix)
        try:
            yield self
        finally:
            self.release(kind, prefix)

    def wait_held(self, count: int = 1, timeout: float = 10.0) -> TierStats:
        """Wait until at least `count` requests are held: a reader is now blocked in FUSE."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats.held >= count:
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"{stats.held} requests held after {timeout} s, not {count}")
            time.sleep(0.01)

    # -- kernel side --------------------------------------------------------------------

    def connection_value(self, name: str) -> int:
        """A fusectl knob of this mount, as the kernel applies it: max_background,
        congestion_threshold, or waiting (requests not yet answered)."""
        return int(read_connection(self.device, name))

    def read_ahead_kb(self) -> int:
        """The mount's readahead window (its bdi's read_ahead_kb)."""
        return int(bdi_file(self.device, "read_ahead_kb").read_text())


@contextmanager
def mount(backing: str | os.PathLike[str], mountpoint: str | os.PathLike[str],
          binary: Path | None = None, **options: Any) -> Iterator[Tier]:
    """Mount the simulator over `backing` at `mountpoint` for the duration of the block.

    Keyword options are TierOptions' fields (latency_ms, jitter_ms, slots, bandwidth,
    chunk_bytes, ...).  Raises FuseUnavailable where FUSE cannot be used.
    """
    tier = Tier(Path(backing), Path(mountpoint), TierOptions(**options), binary).start()
    try:
        yield tier
    finally:
        tier.close()
