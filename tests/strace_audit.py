"""A second, independent audit of what the daemon opens: strace attached to its processes.

open_audit.py asks the kernel's inotify which watched directories saw an open; this
asks the daemon's own system calls. `strace -f -yy -xx` prints every open, openat
and openat2 of the attached processes and their threads, with each fd argument and
result decoded to the path the kernel resolved it to (-y: readlink of
/proc/PID/fd/N at the call; -yy adds `<char M:N>` / `<block M:N>` for devices) and
every string in hex (-xx), so names with any bytes parse without ambiguity.

From those lines, per successful open:
- `path`: what was really opened, however the name was reached (an openat2
  relative to a root fd, a /proc/self/fd/N reopen, a symlink);
- `dirfd_path` and `resolve`: for openat2, the directory it resolved beneath and
  the RESOLVE_* flags, so a test can show the dirfd is a root fd and
  RESOLVE_BENEATH was asked for;
- `o_path`: O_PATH opens name an inode without opening it for I/O (no read, no
  device open() side effects): the native code's first step.
fstat calls are kept too (`Stat`, with st_mode), because what an fd *is* must come
from the kernel at the call: `-yy`'s `<char M:N>` is strace stat()ing the path it
read back (strace's get_finfo_for_dev), which under a rename race describes
whatever holds that name a moment later, not the fd. `unchecked_io_opens` states
the native design as a checkable rule instead: every open for I/O beneath a root is
a /proc/self/fd/N reopen of an fd the same thread fstat'ed as a regular file.

Needs strace and ptrace permission (root, or CAP_SYS_PTRACE); `available()` says why not.
io_uring's IORING_OP_OPENAT would be invisible here: the daemon opens files with
syscalls only (native/open.c), and a new uring open would have to be audited anew.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

OPEN_CALLS = ("open", "openat", "openat2", "creat", "open_by_handle_at")
STAT_CALLS = ("fstat", "newfstatat", "statx")
SYSCALLS = ",".join(OPEN_CALLS + STAT_CALLS)
_HEX = r"(?:\\x[0-9a-f]{2})*"
_LINE = re.compile(
    r"^(?P<pid>\d+) +(?P<call>\w+)\((?P<args>.*)\) += (?P<ret>-?\d+|\?)(?P<rest>.*)$")
_FD = re.compile(rf"^(?P<fd>-?\d+|AT_FDCWD)<(?P<path>{_HEX})(?P<kind><[^>]*>)?>")
_STRING = re.compile(rf'"(?P<s>{_HEX})"')
_RESULT = re.compile(rf"^<(?P<path>{_HEX})(?P<kind><[^>]*>)?>")
_ERRNO = re.compile(r"^ (?P<errno>E[A-Z0-9]+) ")


def unhex(text: str) -> bytes:
    return bytes.fromhex(text.replace("\\x", ""))


@dataclass(frozen=True)
class Open:
    """One open-family call of an audited process, as strace decoded it."""

    pid: int
    call: str
    dirfd_path: bytes | None  # the directory a relative name was resolved from
    name: bytes  # the name argument as passed
    flags: str
    resolve: str  # openat2's RESOLVE_* flags, "" otherwise
    fd: int  # the result: >= 0 an fd, < 0 failed
    errno: str  # "" when it succeeded
    path: bytes | None  # what the result fd names (the real object opened)
    kind: str  # "char M:N" / "block M:N" for devices, "" otherwise
    dirfd: int = -1  # the dirfd argument's number, -1 for none or AT_FDCWD
    view: bool = False  # resolved beneath a root's nodev view (`through_views`)

    @property
    def ok(self) -> bool:
        return self.fd >= 0

    @property
    def o_path(self) -> bool:
        return "O_PATH" in self.flags


@dataclass(frozen=True)
class Stat:
    """An fstat (newfstatat with AT_EMPTY_PATH, or statx) of an fd, and the mode it saw."""

    pid: int
    fd: int
    mode: str  # "S_IFREG", "S_IFCHR", ...; "" when it failed or is not about an fd


def parse(lines: Iterable[str]) -> list[Open | Stat]:
    """Open records from strace output, joining `<unfinished ...>` with `<... resumed>`."""
    pending: dict[int, str] = {}
    records: list[Open | Stat] = []
    for raw in lines:
        line = raw.rstrip("\n")
        head, _, tail = line.partition(" ")
        if not head.isdigit():
            continue
        pid = int(head)
        tail = tail.lstrip()
        if tail.endswith("<unfinished ...>"):
            pending[pid] = tail[: -len("<unfinished ...>")].rstrip()
            continue
        resumed = re.match(r"^<\.\.\. (\w+) resumed>(.*)$", tail)
        if resumed:
            tail = pending.pop(pid, f"{resumed.group(1)}(") + resumed.group(2)
        match = _LINE.match(f"{pid} {tail}")
        if match is None:
            continue
        if match["call"] in OPEN_CALLS:
            records.append(_record(pid, match))
        elif match["call"] in STAT_CALLS:
            records.append(_stat(pid, match))
    return records


def _stat(pid: int, match: re.Match[str]) -> Stat:
    """fstat(N<..>, {st_mode=..}), newfstatat(N<..>, "", {..}, AT_EMPTY_PATH), statx(N, "")."""
    args = match["args"]
    fd_match = _FD.match(args)
    mode = re.search(r"st(?:x)?_mode=(S_IF[A-Z]+)", args)
    by_fd = fd_match is not None and fd_match["fd"] != "AT_FDCWD" and (
        match["call"] == "fstat" or "AT_EMPTY_PATH" in args)
    ok = match["ret"] == "0"
    return Stat(pid=pid, fd=int(fd_match["fd"]) if by_fd and fd_match else -1,
                mode=mode.group(1) if mode and ok and by_fd else "")


def nodev_views(pids: Iterable[int], roots: Iterable[str | os.PathLike[str]]
                ) -> dict[tuple[int, int], bytes]:
    """(pid, fd) -> root: the fds of running processes that are a root's nodev view.

    A worker's probe opens files beneath a copy of a root's mounts flagged nodev
    (native/nodev.c), made at the worker's start, before strace attaches. /proc (and so
    strace -y) names the copy "/", and what is opened beneath it "/rel": the copy is
    attached nowhere. It is the root's very directory all the same (same device, same
    inode), which is how it is told here, from the live fd table.
    """
    ids = {}
    for root in roots:
        st = os.stat(root)
        ids[(st.st_dev, st.st_ino)] = os.fsencode(os.fspath(root)).rstrip(b"/")
    views: dict[tuple[int, int], bytes] = {}
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in names:
            try:
                if os.readlink(f"/proc/{pid}/fd/{name}") != "/":
                    continue
                st = os.stat(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            root = ids.get((st.st_dev, st.st_ino))
            if root is not None:
                views[(pid, int(name))] = root
    return views


def through_views(records: Iterable[Open | Stat], views: dict[tuple[int, int], bytes]
                  ) -> list[Open | Stat]:
    """The records with every open beneath a view spelled as beneath its root."""
    out: list[Open | Stat] = []
    for record in records:
        root = views.get((record.pid, record.dirfd)) if isinstance(record, Open) else None
        if root is None or not isinstance(record, Open) or record.dirfd_path != b"/":
            out.append(record)
            continue
        path = root + record.path if record.path is not None else None
        out.append(dataclasses.replace(record, dirfd_path=root, path=path, view=True))
    return out


def opens_of(records: Iterable[Open | Stat]) -> list[Open]:
    return [r for r in records if isinstance(r, Open)]


def unchecked_io_opens(records: Iterable[Open | Stat], roots: Iterable[str | os.PathLike[str]]
                       ) -> list[Open]:
    """Opens for I/O of something beneath a root that are not the verified reopen, nor an
    openat2 beneath a root's nodev view (`through_views`: there the kernel refuses every
    device, and the probe opens first and checks after, native/nodev.c).

    The rule (native/open.c reopen(), kv/discover.py _open_regular()): resolve with
    O_PATH, fstat that fd, refuse all but regular files, then open /proc/self/fd/N (or
    N relative to a held /proc/self/fd: native/probe.c, which strace shows as the dirfd
    /proc/PID/fd, PID the caller's own). So a non-O_PATH open beneath a root must name
    /proc/self/fd/N, and the last fstat of N by the same thread must have said S_IFREG.
    The thread matters: the kernel keeps one fd table per process, but each worker
    thread resolves and reopens its own items.
    """
    roots = list(roots)
    seen: dict[tuple[int, int], str] = {}
    bad: list[Open] = []
    for record in records:
        if isinstance(record, Stat):
            if record.fd >= 0:
                seen[(record.pid, record.fd)] = record.mode
            continue
        if record.ok and record.o_path:
            seen.pop((record.pid, record.fd), None)  # a new fd: nothing known about it yet
        if not record.ok or record.o_path or record.path is None or not beneath(record.path,
                                                                                roots):
            continue
        if record.view and "RESOLVE_BENEATH" in record.resolve:
            continue  # opened first, checked after: the view's mount refuses every device
        reopen = re.fullmatch(rb"/proc/self/fd/(\d+)", record.name)
        if reopen is None and record.dirfd_path == b"/proc/%d/fd" % record.pid:
            reopen = re.fullmatch(rb"(\d+)", record.name)
        if reopen is None or seen.get((record.pid, int(reopen.group(1)))) != "S_IFREG":
            bad.append(record)
    return bad


def _record(pid: int, match: re.Match[str]) -> Open:
    call, args, rest = match["call"], match["args"], match["rest"]
    dirfd_path: bytes | None = None
    dirfd = -1
    if call in ("openat", "openat2", "open_by_handle_at"):
        fd_match = _FD.match(args)
        if fd_match:
            dirfd_path = unhex(fd_match["path"])
            dirfd = int(fd_match["fd"]) if fd_match["fd"] != "AT_FDCWD" else -1
            args = args[fd_match.end():].lstrip(", ")
    string = _STRING.search(args)
    name = unhex(string["s"]) if string else b""
    after = args[string.end():] if string else args
    flags = resolve = ""
    if call == "openat2":
        flags_match = re.search(r"flags=([A-Z_0-9|]+)", after)
        resolve_match = re.search(r"resolve=([A-Z_0-9|]+)", after)
        flags = flags_match.group(1) if flags_match else ""
        resolve = resolve_match.group(1) if resolve_match else ""
    else:
        flags_match = re.search(r"(O_[A-Z_0-9|]+)", after)
        flags = flags_match.group(1) if flags_match else ""
    ret = match["ret"]
    fd = int(ret) if ret != "?" else -1
    errno_match = _ERRNO.match(rest)
    result = _RESULT.match(rest)
    return Open(
        pid=pid, call=call, dirfd_path=dirfd_path, name=name, flags=flags, resolve=resolve,
        fd=fd, errno=errno_match["errno"] if errno_match else "",
        path=unhex(result["path"]) if result and fd >= 0 else None,
        kind=(result["kind"] or "").strip("<>") if result and fd >= 0 else "", dirfd=dirfd,
    )


def available() -> str | None:
    """None when strace can attach here, else why not (for a clean skip)."""
    if shutil.which("strace") is None:
        return "strace is not installed"
    probe = subprocess.Popen(["sleep", "5"])
    try:
        done = subprocess.run(
            ["strace", "-qq", "-e", "trace=none", "-p", str(probe.pid)],
            capture_output=True, text=True, timeout=3, check=False,
        )
        if done.returncode != 0:
            return f"strace cannot attach: {done.stderr.strip()[:200]}"
    except subprocess.TimeoutExpired:
        pass  # still attached after 3 s: ptrace works (the probe sleeps 5)
    finally:
        probe.kill()
        probe.wait()
    return None


class StraceAudit:
    """strace attached to running processes (and every thread they have or start)."""

    def __init__(self, pids: Iterable[int], out: Path) -> None:
        self.pids = list(pids)
        self.out = out
        command = ["strace", "-f", "-yy", "-xx", "-s", "65536", "-e", f"trace={SYSCALLS}",
                   "-o", str(out)]
        for pid in self.pids:
            command += ["-p", str(pid)]
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        self._wait_attached()

    def _wait_attached(self, timeout: float = 20.0) -> None:
        """strace reports 'Process N attached' per thread; wait for every process asked for."""
        assert self.process.stderr is not None
        wanted = set(self.pids)
        deadline = time.monotonic() + timeout
        while wanted:
            line = self.process.stderr.readline()
            if not line:
                raise RuntimeError(f"strace exited before attaching (rc {self.process.poll()})")
            attached = re.search(r"Process (\d+) attached", line)
            if attached:
                wanted.discard(int(attached.group(1)))
            if time.monotonic() > deadline:
                raise RuntimeError(f"strace did not attach to {sorted(wanted)}")

    def stop(self) -> list[Open | Stat]:
        """Detach (SIGINT lets strace detach cleanly) and parse everything recorded."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stderr is not None:
            self.process.stderr.close()
        with open(self.out, errors="replace") as handle:
            return parse(handle)


def beneath(path: bytes, roots: Iterable[str | os.PathLike[str]]) -> bool:
    """Is path one of the roots or beneath one (lexically: strace shows resolved paths)?"""
    for root in roots:
        prefix = os.fsencode(os.fspath(root)).rstrip(b"/")
        if path == prefix or path.startswith(prefix + b"/"):
            return True
    return False
