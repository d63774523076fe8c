"""Real FUSE tiers nobody here wrote: s3fs-fuse and rclone mounted over a local S3 endpoint.

What the bench (bench/realtier.py) and the tests (tests/integration/test_real_tiers.py)
share, issue 24 item 1:

- `Endpoint`: an S3 server on loopback serving a bucket from a private tmpfs (so the
  `drop_caches` that makes a tier cold never makes the endpoint read its disk), and a
  dataset of N objects of S bytes of distinct random content uploaded to it.
  The server is s3rver (npm, installed by ./dev into .venv/node), several processes over
  one directory: one process served ~65 GETs/s of 4 MiB objects here, moto's server ~25
  (issue 24); bench/README.md "Real tiers" has the ceiling.
- `DelayProxy`: a TCP relay on loopback that adds a one-way delay each way (relay.py's
  idea: stamped chunks, one writer per direction, nothing reordered) and counts the HTTP
  requests that cross it, by method and by kind (object GET, HEAD, bucket LIST): the
  mounts talk to the endpoint only through it, so its counters say what a consumer
  still had to fetch after a warm-up.
- `mount(kind, config, ...)`: a context manager with a read-only mount of one tier
  configuration (`CONFIGS`), waited for until it answers, unmounted reliably, its
  process killed and its disk cache removed. `Mount.cold()` is what makes the tier cold
  for the next method: unmount, clear the file system's own disk cache, drop the page
  cache, settle, remount.
- `RealTierUnavailable` (not root, no /dev/fuse, a package missing) and `required()`:
  with KVPREFETCH_REQUIRE_REALTIER=1 (CI) "cannot mount" is a failure, not a skip.

The kernel's FUSE `max_background` is left as each file system sets it (12, the kernel's
default, for both here: what a user runs) and recorded per mount from fusectl.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

from kvharness.relay import relay

REQUIRE_ENV = "KVPREFETCH_REQUIRE_REALTIER"
ROOT = Path(__file__).resolve().parents[2]
NODE_PREFIX = ROOT / ".venv" / "node"  # ./dev: npm install --prefix .venv/node s3rver
S3RVER = NODE_PREFIX / "node_modules" / "s3rver" / "bin" / "s3rver.js"
BUCKET = "kvcache"
# s3rver's built-in credentials (its README).
ACCESS_KEY = "S3RVER"
SECRET_KEY = "S3RVER"
FUSECTL = Path("/sys/fs/fuse/connections")
READY_TIMEOUT = 30.0
ENDPOINT_PROCESSES = 3  # s3rver processes behind the proxy (Endpoint.start says why)
SETTLE_S = 3.0  # the VM hands pages freed by drop_caches back 2-3 s later (bench/README.md)

# (kind, config) -> what a user types; `extent` of a scenario is separate (the bench's table).
CONFIGS: dict[str, tuple[str, ...]] = {
    "s3fs": ("defaults", "kernel_cache", "use_cache"),
    "rclone": ("vfs_off", "vfs_full"),
}
TOOLS = {"s3fs": "s3fs", "rclone": "rclone"}
DEBIAN_PACKAGES = {"s3fs": "s3fs (Debian's s3fs-fuse)", "rclone": "rclone"}


class RealTierUnavailable(RuntimeError):
    """A real tier cannot be mounted here; the message says why and what would fix it.

    Tests skip on it, except when KVPREFETCH_REQUIRE_REALTIER=1 (CI sets it: ./dev installs
    every package there and the job runs as root with /dev/fuse, so failing to mount is a
    bug to see).
    """


def required() -> bool:
    """True where real tiers must work (CI): being unable to mount is then a failure."""
    return os.environ.get(REQUIRE_ENV) == "1"


def check_available(kinds: Sequence[str] = tuple(CONFIGS)) -> None:
    """Raise RealTierUnavailable unless this process can serve S3 and mount these kinds."""
    if os.geteuid() != 0:
        raise RealTierUnavailable("real tiers need root (FUSE mounts with allow_other, "
                                  "drop_caches, fusectl)")
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC))
    except OSError as exc:
        raise RealTierUnavailable(f"/dev/fuse cannot be opened ({exc.strerror}): no FUSE in "
                                  "this kernel or container") from exc
    for kind in kinds:
        if shutil.which(TOOLS[kind]) is None:
            raise RealTierUnavailable(f"{TOOLS[kind]} not found: apt-get install "
                                      f"{DEBIAN_PACKAGES[kind]} (./dev setup does, as root)")
    if shutil.which("fusermount3") is None and shutil.which("fusermount") is None:
        raise RealTierUnavailable("fusermount3 not found: apt-get install fuse3")
    if not S3RVER.exists() or shutil.which("node") is None:
        raise RealTierUnavailable(f"the S3 endpoint is missing ({S3RVER}): ./dev setup "
                                  "installs s3rver from npm (needs node and npm)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for(predicate: Any, timeout: float, what: str, poll: float = 0.05) -> None:
    """Poll predicate() until true; TimeoutError naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(poll)


def answers(port: int) -> bool:
    with contextlib.suppress(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    return False


# --- the endpoint ----------------------------------------------------------------------------


@dataclass
class Dataset:
    """N objects of S bytes (keys kv/f00000.bin ...), each of distinct random content."""

    files: int
    size: int
    keys: list[str] = field(default_factory=list)


class Endpoint:
    """An S3 server on 127.0.0.1:port serving from a private tmpfs under workdir."""

    def __init__(self, workdir: Path, processes: int = 1) -> None:
        self.kind = "s3rver"
        self.workdir = workdir
        self.data = workdir / "endpoint-data"
        self.ports = [free_port() for _ in range(processes)]
        self.processes: list[subprocess.Popen[bytes]] = []
        self._tmpfs = False
        self.dataset = Dataset(0, 0)

    @property
    def port(self) -> int:
        """The first server's port: the one uploads go to."""
        return self.ports[0]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self, port: int) -> list[str]:
        return ["node", str(S3RVER), "-d", str(self.data), "-a", "127.0.0.1",
                "-p", str(port), "--silent", "--configure-bucket", BUCKET]

    def start(self) -> None:
        """Every server process, answering; the bucket made.

        s3rver is one node process, CPU-bound at about one core when it streams 4 MiB
        objects: several processes serve the same directory (objects are plain files
        there, read per request), and the proxy spreads connections over them.
        """
        self.data.mkdir(parents=True, exist_ok=True)
        # A tmpfs of its own: drop_caches never drops it, so a cold tier never makes the
        # endpoint read a disk (the tier is what is measured, not this machine's disk).
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "kvrealtier",
                        str(self.data)], check=True, capture_output=True)
        self._tmpfs = True
        try:
            for index, port in enumerate(self.ports):
                log = open(self.workdir / f"endpoint-{self.kind}-{index}.log", "wb")  # noqa: SIM115
                with log:
                    self.processes.append(subprocess.Popen(
                        self.argv(port), stdout=log, stderr=subprocess.STDOUT,
                        start_new_session=True))
            for port, process in zip(self.ports, self.processes, strict=True):
                wait_for(lambda port=port, process=process: answers(port)
                         or process.poll() is not None,
                         READY_TIMEOUT, f"{self.kind} on port {port}")
                if process.poll() is not None:
                    raise RuntimeError(f"{self.kind} exited: {self.log()[-2000:]}")
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        return "".join(path.read_text(errors="replace")
                       for path in sorted(self.workdir.glob(f"endpoint-{self.kind}-*.log")))

    def request(self, method: str, path: str, body: bytes | None = None,
                connection: HTTPConnection | None = None) -> bytes:
        """One plain HTTP request (s3rver takes unsigned ones); the body, raises
        on a status other than 2xx."""
        own = connection is None
        conn = connection or HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=body)
            response = conn.getresponse()
            data = response.read()
            if not 200 <= response.status < 300:
                raise RuntimeError(f"{method} {path}: {response.status} {data[:200]!r}")
            return data
        finally:
            if own:
                conn.close()

    def upload(self, files: int, size: int, threads: int = 8) -> Dataset:
        """files objects of size bytes, distinct random content each, uploaded in parallel."""
        keys = [f"f{i:05d}.bin" for i in range(files)]
        jobs: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        errors: list[BaseException] = []

        def worker() -> None:
            conn = HTTPConnection("127.0.0.1", self.port, timeout=120)
            try:
                while (key := jobs.get()) is not None:
                    self.request("PUT", f"/{BUCKET}/{key}", secrets.token_bytes(size), conn)
            except BaseException as error:  # reported below
                errors.append(error)
            finally:
                conn.close()

        for key in keys:
            jobs.put(key)
        pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
        for thread in pool:
            jobs.put(None)
            thread.start()
        for thread in pool:
            thread.join()
        if errors:
            raise errors[0]
        self.dataset = Dataset(files, size, keys)
        return self.dataset

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        self.processes = []
        if self._tmpfs:
            subprocess.run(["umount", "-l", str(self.data)], check=False, capture_output=True)
            self._tmpfs = False
        shutil.rmtree(self.data, ignore_errors=True)


def _rate(port: int, keys: Sequence[str], method: str, clients: int,
          seconds: float) -> tuple[float, float]:
    """(requests/s, bytes/s) of `method` on keys from `clients` keep-alive connections."""
    counts = [0] * clients
    volume = [0] * clients
    stop = time.monotonic() + seconds

    def client(slot: int) -> None:
        conn = HTTPConnection("127.0.0.1", port, timeout=60)
        i = slot
        while time.monotonic() < stop:
            conn.request(method, f"/{BUCKET}/{keys[i % len(keys)]}")
            response = conn.getresponse()
            volume[slot] += len(response.read())
            if response.status != 200:
                raise RuntimeError(f"{method} {keys[i % len(keys)]}: {response.status}")
            counts[slot] += 1
            i += clients
        conn.close()

    started = time.monotonic()
    pool = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    wall = time.monotonic() - started
    return sum(counts) / wall, sum(volume) / wall


def ceiling(port: int, keys: Sequence[str], clients: int = 16,
            seconds: float = 5.0) -> dict[str, float]:
    """GETs/s (whole objects) and HEADs/s the server at port answers from `clients`
    keep-alive connections, each round-robin over keys, for `seconds` each."""
    gets, volume = _rate(port, keys, "GET", clients, seconds)
    heads, _ = _rate(port, keys, "HEAD", clients, seconds)
    return {"get_per_s": round(gets, 1), "get_mb_per_s": round(volume / 1e6, 1),
            "head_per_s": round(heads, 1), "clients": clients}


# --- the latency proxy -----------------------------------------------------------------------


class RequestCounter:
    """Counts HTTP/1.1 requests in one client->server byte stream, by kind.

    A read-only mount sends requests without bodies (GET, HEAD; a body is skipped by its
    Content-Length), so a request ends at its blank line. Kinds: GET (an object: a key
    in the path), LIST (a GET on the bucket: a listing), HEAD, and the method otherwise.
    """

    def __init__(self, count: Callable[[str], None]) -> None:
        self.buffer = b""
        self.skip = 0
        self.count = count

    def feed(self, data: bytes) -> None:
        if self.skip:
            used = min(self.skip, len(data))
            self.skip -= used
            data = data[used:]
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head, self.buffer = self.buffer[:end], self.buffer[end + 4:]
            lines = head.split(b"\r\n")
            method, _, rest = lines[0].decode("latin-1").partition(" ")
            target = rest.rpartition(" ")[0]
            path = urllib.parse.urlsplit(target).path.strip("/")
            kind = "LIST" if method == "GET" and "/" not in path else method
            self.count(kind)
            for line in lines[1:]:
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    self.skip = int(value.strip())
            if self.skip:
                used = min(self.skip, len(self.buffer))
                self.skip -= used
                self.buffer = self.buffer[used:]


KINDS = ("GET", "HEAD", "LIST", "other")  # what DelayProxy counts


class _Relay:
    """The proxy's inside, run in its own process (DelayProxy): its threads never compete
    for a GIL with the warmers and the consumer being measured."""

    def __init__(self, server: socket.socket, to: list[tuple[str, int]], delay: float,
                 counters: mmap.mmap) -> None:
        self.server = server
        self.to = to
        self.delay = delay
        self.counters = counters  # len(KINDS) native int64, which DelayProxy reads
        self._next = 0
        self._lock = threading.Lock()

    def serve(self) -> None:
        while True:
            client, _ = self.server.accept()
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _count(self, kind: str) -> None:
        offset = 8 * (KINDS.index(kind) if kind in KINDS else len(KINDS) - 1)
        with self._lock:
            value = struct.unpack_from("q", self.counters, offset)[0]
            struct.pack_into("q", self.counters, offset, value + 1)

    def _relay(self, client: socket.socket) -> None:
        with self._lock:  # connections round-robin over the endpoint's processes
            to = self.to[self._next % len(self.to)]
            self._next += 1
        relay(client, to, self.delay, RequestCounter(self._count).feed)


def serve_proxy(argv: Sequence[str]) -> None:
    """The proxy process: `python -m kvharness.realtier COUNTERS DELAY_MS PORT...`; prints
    its own port once listening."""
    counters_path, delay_ms, *ports = argv
    with open(counters_path, "r+b") as handle:
        counters = mmap.mmap(handle.fileno(), 8 * len(KINDS))
    server = socket.create_server(("127.0.0.1", 0))
    print(server.getsockname()[1], flush=True)
    _Relay(server, [("127.0.0.1", int(port)) for port in ports], float(delay_ms) / 1000,
           counters).serve()


class DelayProxy:
    """127.0.0.1:port -> the endpoint's processes (a connection each, round-robin),
    `delay_ms` one way each direction (relay.py's pump), counting the requests that cross
    it (`counts()`, from a shared mmap). A process of its own: its threads never compete
    for a GIL with the warmers and the consumer being measured."""

    def __init__(self, to_ports: Sequence[int], delay_ms: float, workdir: Path) -> None:
        self.delay_ms = delay_ms
        counters = workdir / f"proxy-counters-{os.getpid()}-{id(self)}"
        counters.write_bytes(bytes(8 * len(KINDS)))
        with open(counters, "rb") as handle:
            self._counters = mmap.mmap(handle.fileno(), 8 * len(KINDS), prot=mmap.PROT_READ)
        bench = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (bench, os.environ.get("PYTHONPATH")) if p)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "kvharness.realtier", str(counters), str(delay_ms),
             *(str(port) for port in to_ports)],
            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": path},
            start_new_session=True)
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"the delay proxy did not start ({self._process.poll()})")
        self.port = int(line)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def counts(self) -> dict[str, int]:
        values = struct.unpack_from(f"{len(KINDS)}q", self._counters, 0)
        return dict(zip(KINDS, values, strict=True))

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
        self._process.wait(10)


def requests_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {kind: after.get(kind, 0) - before.get(kind, 0) for kind in KINDS}


@contextlib.contextmanager
def endpoint(workdir: Path, files: int, size: int, delay_ms: float,
             processes: int = ENDPOINT_PROCESSES) -> Iterator[tuple[Endpoint, DelayProxy]]:
    """A started endpoint with a dataset uploaded and a delay proxy in front of it."""
    check_available(())
    workdir.mkdir(parents=True, exist_ok=True)
    server = Endpoint(workdir, processes)
    server.start()
    try:
        server.upload(files, size)
        proxy = DelayProxy(server.ports, delay_ms, workdir)
        try:
            yield server, proxy
        finally:
            proxy.close()
    finally:
        server.stop()


# --- the mounts ------------------------------------------------------------------------------


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def fuse_connection(mountpoint: Path | str) -> Path:
    """The FUSE mount's fusectl directory, fusectl mounted here when it is not (as
    systemd mounts it at boot): its limits, and the `waiting` count the daemon judges
    admission by (native/gauge.c). It may not exist (not root, not FUSE)."""
    if not FUSECTL.is_dir() or not any(FUSECTL.iterdir()):
        subprocess.run(["mount", "-t", "fusectl", "none", str(FUSECTL)], check=False,
                       capture_output=True)
    return FUSECTL / str(os.minor(os.stat(mountpoint).st_dev))


def fuse_limits(mountpoint: Path) -> dict[str, int | None]:
    """The mount's FUSE connection limits from fusectl (mounted here when it is not)."""
    connection = fuse_connection(mountpoint)
    limits: dict[str, int | None] = {}
    for name in ("max_background", "congestion_threshold"):
        try:
            limits[name] = int((connection / name).read_text())
        except (OSError, ValueError):
            limits[name] = None
    return limits


def clean_environment() -> dict[str, str]:
    """This environment less AWS_*: the endpoint is plain http on loopback, and a host's
    AWS_CA_BUNDLE (set on this project's machines) makes rclone's S3 backend refuse to
    start ("LoadCustomCABundleError: ... unsupported transport")."""
    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}


def is_mounted(mountpoint: Path) -> bool:
    target = str(mountpoint)
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        return any(line.split()[4] == target for line in f)


@dataclass
class Mount:
    """One read-only mount of (kind, config) over the proxy; remountable (cold())."""

    kind: str
    config: str
    url: str
    workdir: Path
    settle: float = SETTLE_S
    files: int = 0
    process: subprocess.Popen[bytes] | None = None
    limits: dict[str, int | None] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.workdir / "mnt"

    @property
    def cache_dir(self) -> Path | None:
        """The file system's own disk cache (the near tier), for the configs that have one."""
        if (self.kind, self.config) in (("s3fs", "use_cache"), ("rclone", "vfs_full")):
            return self.workdir / "cache"
        return None

    @property
    def fstype(self) -> str:
        return f"fuse.{self.kind}"

    def argv(self) -> tuple[list[str], dict[str, str]]:
        """The command line and environment a user would run for this config (foreground,
        so this process owns the file system's process)."""
        mnt, cache = str(self.path), self.cache_dir
        if self.kind == "s3fs":
            options = ["ro", "allow_other", f"url={self.url}", "use_path_request_style",
                       f"passwd_file={self.workdir / 'passwd-s3fs'}"]
            if self.config == "kernel_cache":
                options.append("kernel_cache")
            elif self.config == "use_cache":
                options.append(f"use_cache={cache}")
            return ["s3fs", BUCKET, mnt, "-f", "-o", ",".join(options)], {}
        if self.kind == "rclone":
            mode = "full" if self.config == "vfs_full" else "off"
            argv = ["rclone", "mount", f":s3:{BUCKET}", mnt, "--read-only", "--allow-other",
                    "--vfs-cache-mode", mode]
            if cache is not None:
                argv += ["--cache-dir", str(cache)]
            env = {"RCLONE_CONFIG": str(self.workdir / "rclone.conf"),
                   "RCLONE_S3_PROVIDER": "Other", "RCLONE_S3_ENDPOINT": self.url,
                   "RCLONE_S3_ACCESS_KEY_ID": ACCESS_KEY,
                   "RCLONE_S3_SECRET_ACCESS_KEY": SECRET_KEY,
                   "RCLONE_S3_FORCE_PATH_STYLE": "true"}
            return argv, env
        raise ValueError(f"no tier kind {self.kind!r}: {sorted(CONFIGS)}")

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        passwd = self.workdir / "passwd-s3fs"
        passwd.write_text(f"{ACCESS_KEY}:{SECRET_KEY}\n")
        passwd.chmod(0o600)
        (self.workdir / "rclone.conf").touch()
        argv, env = self.argv()
        log = open(self.workdir / "mount.log", "ab")  # noqa: SIM115
        with log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            env={**clean_environment(), **env},
                                            start_new_session=True)

        def ready() -> bool:
            if self.process is None or self.process.poll() is not None:
                return True
            if not is_mounted(self.path):
                return False
            with contextlib.suppress(OSError):
                return len(os.listdir(self.path)) >= self.files
            return False

        try:
            wait_for(ready, READY_TIMEOUT, f"{self.kind} {self.config} at {self.path}", 0.1)
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.process.returncode}: "
                                   f"{self.log()[-2000:]}")
        except BaseException:
            self.unmount()
            raise
        self.limits = fuse_limits(self.path)

    def log(self) -> str:
        return (self.workdir / "mount.log").read_text(errors="replace")

    def unmount(self) -> None:
        """fusermount3 -u, then a lazy umount if busy; the fs process ended either way."""
        if is_mounted(self.path):
            done = subprocess.run(["fusermount3", "-u", str(self.path)], check=False,
                                  capture_output=True)
            if done.returncode != 0:
                subprocess.run(["umount", "-l", str(self.path)], check=False,
                               capture_output=True)
        if self.process is not None:
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
            self.process = None

    def clear_cache(self) -> None:
        if self.cache_dir is not None:
            shutil.rmtree(self.cache_dir, ignore_errors=True)

    def cold(self) -> None:
        """Unmount, clear the disk cache, drop the page cache, settle, remount: nothing
        of the previous method's warm-up is left anywhere a consumer could find it."""
        self.unmount()
        self.clear_cache()
        drop_caches()
        time.sleep(self.settle)
        self.mount()

    def paths(self) -> list[str]:
        return sorted(str(self.path / name) for name in os.listdir(self.path))

    def settings(self) -> dict[str, Any]:
        argv, env = self.argv()
        return {"kind": self.kind, "config": self.config, "fstype": self.fstype,
                "argv": argv, "env": {k: v for k, v in env.items() if "SECRET" not in k},
                "fuse": self.limits}


@contextlib.contextmanager
def mount(kind: str, config: str, url: str, workdir: Path, *, files: int = 0,
          settle: float = SETTLE_S) -> Iterator[Mount]:
    """A read-only mount of (kind, config) over the S3 endpoint at url (the proxy's);
    waited for until it lists `files` entries; unmounted and its cache removed after."""
    if config not in CONFIGS.get(kind, ()):
        raise ValueError(f"no config {kind}/{config}: {CONFIGS}")
    check_available((kind,))
    workdir.mkdir(parents=True, exist_ok=True)
    fs = Mount(kind, config, url, workdir, settle, files)
    fs.clear_cache()
    fs.mount()
    try:
        yield fs
    finally:
        fs.unmount()
        fs.clear_cache()


if __name__ == "__main__":
    serve_proxy(sys.argv[1:])
