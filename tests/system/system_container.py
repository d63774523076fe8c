"""systemd booted as PID 1 of a systemd-nspawn container, and always torn down again.

The host need not run systemd (here PID 1 is a VM agent): nspawn boots the container's
own systemd 252 from the cached tree (system_rootfs.py). How, and why each option:

- The container gets a fresh cgroup of its own, `kvp-system-PID` at the top of every
  cgroup hierarchy the host has mounted, which nspawn is started in. With
  --keep-unit and --register=no (there is no host systemd bus to ask for a scope) nspawn
  uses the cgroup it was started in and splits it into `payload` and `supervisor`
  (systemd-nspawn(1)). Our own cgroup is what makes teardown total: whatever survives the
  container's shutdown is killed through cgroup.kill (cgroup v2, Linux 5.14) and the
  directories are removed, in every hierarchy.
- SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1 on a hybrid host (cgroup v1 controllers plus a
  cgroup2 mount at /sys/fs/cgroup/unified, as here): the container sees a pure cgroup2
  tree, on which systemd can attach the BPF programs of IPAddressDeny= (together with
  CAP_NET_ADMIN, CAP_BPF and the bpf system call, which nspawn withholds by default).
- --volatile=overlay: the cached tree is the read-only lower layer of an overlayfs with a
  tmpfs on top (systemd-nspawn(1)), all inside the container's mount namespace: every
  run starts from the same tree, and nothing is mounted on the host.
- --private-network: only a loopback; the project is installed offline.
- nspawn runs in a session of its own, so a Ctrl-C reaches pytest, whose teardown shuts
  the container down in order, rather than nspawn in the middle of a test.

Commands run inside with nsenter(1) into all of the container's namespaces, with a clean
environment (the host's PIP_* and the like must not leak in), each in the cgroup
`kvp-system-PID/exec`: what a timed-out or interrupted command leaves running is found
there and killed before the halt, which it would otherwise hold up (see _stop_commands).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

NAME_PREFIX = "kvp-system-"
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BOOT_TIMEOUT = 120.0
HALT_TIMEOUT = 30.0
KILL_TIMEOUT = 10.0
NSPAWN_PROPAGATE = Path("/run/systemd/nspawn/propagate")
# The cgroup, beside nspawn's `payload` and `supervisor`, of every command run inside.
EXEC_CGROUP = "exec"


class ContainerUnavailable(RuntimeError):
    """nspawn cannot boot systemd here; the message says why."""


class CommandFailed(AssertionError):
    """A command inside the container failed; the message has its output."""


# ---- cgroups -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hierarchy:
    mount: Path
    unified: bool  # cgroup2; else the named v1 hierarchy `name=systemd`


def cgroup_hierarchies() -> list[Hierarchy]:
    """The cgroup2 mount and the v1 `name=systemd` hierarchy, where mounted (mountinfo)."""
    found = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            before, _, after = line.partition(" - ")
            point = Path(before.split()[4])
            fstype, _source, options = after.split()[:3]
            if fstype == "cgroup2":
                found.append(Hierarchy(point, unified=True))
            elif fstype == "cgroup" and "name=systemd" in options.split(","):
                found.append(Hierarchy(point, unified=False))
    return found


def _remove_cgroup_tree(path: Path) -> None:
    """rmdir a cgroup and its children, deepest first (a cgroup is removed empty, by rmdir)."""
    if not path.is_dir():
        return
    for child in sorted((p for p in path.rglob("*") if p.is_dir()),
                        key=lambda p: len(p.parts), reverse=True):
        _rmdir_retrying(child)
    _rmdir_retrying(path)


def _rmdir_retrying(path: Path) -> None:
    # EBUSY while the last processes are still exiting.
    deadline = time.monotonic() + KILL_TIMEOUT
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as error:
            if error.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _cgroup_pids(path: Path) -> list[int]:
    pids: list[int] = []
    if not path.is_dir():
        return pids
    for procs in path.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            pids += [int(pid) for pid in procs.read_text().split()]
    return pids


def _kill_cgroup(hierarchies: Sequence[Hierarchy], name: str) -> None:
    """SIGKILL everything left in our cgroup: cgroup.kill where there is one, else by pid."""
    for hierarchy in hierarchies:
        kill = hierarchy.mount / name / "cgroup.kill"
        if kill.exists():
            kill.write_text("1")
    deadline = time.monotonic() + KILL_TIMEOUT
    while True:
        left = [pid for h in hierarchies for pid in _cgroup_pids(h.mount / name)]
        if not left:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {left} in cgroup {name} survive SIGKILL")
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale(hierarchies: Sequence[Hierarchy]) -> list[str]:
    """Kill and remove containers a run left behind when it was itself killed (SIGKILL):
    our cgroups whose owner (the pid in the name) is gone."""
    reaped = []
    names = {
        entry.name for h in hierarchies if h.mount.is_dir() for entry in h.mount.iterdir()
        if entry.is_dir() and re.fullmatch(re.escape(NAME_PREFIX) + r"\d+", entry.name)
    }
    for name in sorted(names):
        if _pid_alive(int(name[len(NAME_PREFIX):])):
            continue
        _kill_cgroup(hierarchies, name)
        for hierarchy in hierarchies:
            _remove_cgroup_tree(hierarchy.mount / name)
        _remove_propagation_dir(name)
        reaped.append(name)
    return reaped


def _remove_propagation_dir(name: str) -> None:
    """nspawn's per-machine mount-propagation directory; it leaves it when /run is no tmpfs."""
    with contextlib.suppress(FileNotFoundError, OSError):
        (NSPAWN_PROPAGATE / name).rmdir()


# ---- the container -------------------------------------------------------------------------


def nspawn_problem() -> str | None:
    """Why nspawn cannot boot a systemd with enforceable IPAddressDeny= here, or None."""
    if os.geteuid() != 0:
        return "not root: systemd-nspawn needs root"
    for tool in ("systemd-nspawn", "nsenter"):
        if not any(os.access(Path(d) / tool, os.X_OK)
                   for d in os.environ.get("PATH", CONTAINER_PATH).split(":")):
            return f"{tool} is not installed (./dev test-system installs systemd-container)"
    if not any(h.unified for h in cgroup_hierarchies()):
        return "no cgroup2 hierarchy mounted: the unit's IPAddressDeny= needs it"
    return None


class Container:
    """One booted container; `shutdown()` is idempotent and leaves nothing behind."""

    def __init__(self, rootfs: Path, console_log: Path) -> None:
        self.rootfs = rootfs
        self.console_log = console_log
        self.name = f"{NAME_PREFIX}{os.getpid()}"
        self.hierarchies = cgroup_hierarchies()
        self.process: subprocess.Popen[bytes] | None = None
        self.leader = 0  # the container's PID 1 (systemd), as a host pid
        self.boot_seconds = 0.0

    # -- lifecycle --

    def boot(self) -> None:
        started = time.monotonic()
        for hierarchy in self.hierarchies:
            (hierarchy.mount / self.name).mkdir()
            (hierarchy.mount / self.name / EXEC_CGROUP).mkdir()
        environment = dict(os.environ)
        if not any(h.unified and h.mount == Path("/sys/fs/cgroup") for h in self.hierarchies):
            environment["SYSTEMD_NSPAWN_UNIFIED_HIERARCHY"] = "1"  # a hybrid host
        command = [
            "systemd-nspawn", "--quiet", "--directory", str(self.rootfs), "--boot",
            "--machine", self.name, "--volatile=overlay", "--private-network",
            "--console=pipe", "--register=no", "--keep-unit",
            "--capability=CAP_NET_ADMIN,CAP_BPF", "--system-call-filter=bpf",
        ]
        procs_files = [h.mount / self.name / "cgroup.procs" for h in self.hierarchies]

        def join_own_cgroup() -> None:  # in the child, before exec
            for procs in procs_files:
                procs.write_text("0")

        with open(self.console_log, "ab") as console:
            self.process = subprocess.Popen(
                command, env=environment, stdin=subprocess.DEVNULL, stdout=console,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=join_own_cgroup,
            )
        deadline = started + BOOT_TIMEOUT
        self.leader = self._wait_for_leader(deadline)
        while True:
            # Until systemd has created /run/systemd/system, systemctl takes the machine
            # for one not booted with systemd and prints "offline" (sd_booted(3)); until
            # /run/systemd/private exists it cannot reach it ("Failed to connect to bus")
            # and prints no state; then --wait waits for the boot to finish. The first
            # CI run met "offline": systemd had exec'ed but not yet made its directory.
            state = self.run(["systemctl", "is-system-running", "--wait"], check=False,
                             timeout=max(1.0, deadline - time.monotonic()))
            if state.stdout.strip() not in ("", "offline") or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if state.stdout.strip() not in ("running", "degraded"):
            raise ContainerUnavailable(
                f"the container's systemd did not finish booting: {state.stdout.strip()!r} "
                f"{state.stderr.strip()!r}; console: {self.console_tail()}"
            )
        self.boot_seconds = time.monotonic() - started

    def _wait_for_leader(self, deadline: float) -> int:
        """The container's init: nspawn's child once it has exec'ed systemd."""
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ContainerUnavailable(
                    f"systemd-nspawn exited with status {self.process.returncode}: "
                    f"{self.console_tail()}"
                )
            for child in _children(self.process.pid):
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{child}/comm").read_text().strip() == "systemd":
                        return child
            time.sleep(0.05)
        raise ContainerUnavailable(f"no systemd in the container after {BOOT_TIMEOUT:.0f} s: "
                                   f"{self.console_tail()}")

    def shutdown(self) -> list[str]:
        """Halt the container (SIGTERM to nspawn: a clean poweroff inside), kill whatever is
        left in its cgroup, and remove the cgroups. Returns what had to be forced."""
        forced = []
        stopped = self._stop_commands()
        if stopped:
            forced.append(f"{stopped} processes of commands run inside were still running")
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(HALT_TIMEOUT)
            except subprocess.TimeoutExpired:
                forced.append(f"the container did not halt within {HALT_TIMEOUT:.0f} s")
        if any(_cgroup_pids(h.mount / self.name) for h in self.hierarchies):
            forced.append("processes left in the cgroup were killed")
            _kill_cgroup(self.hierarchies, self.name)
        if self.process is not None:
            self.process.wait(KILL_TIMEOUT)
        for hierarchy in self.hierarchies:
            _remove_cgroup_tree(hierarchy.mount / self.name)
        _remove_propagation_dir(self.name)
        self.process = None
        return forced

    def _stop_commands(self) -> int:
        """Kill what commands run inside left running (a timed-out or interrupted one).

        Measured: one such process still running delays the container's halt by 10 s, or
        past 30 s while its nsenter waits for it (their parents are outside the container,
        where its systemd cannot reap them). The processes inside go first, so that each
        nsenter reaps its child and exits; then whatever is left of the nsenters.
        """
        exec_cgroup = f"{self.name}/{EXEC_CGROUP}"
        pids = {pid for h in self.hierarchies for pid in _cgroup_pids(h.mount / exec_cgroup)}
        own = _pid_namespace(os.getpid())
        inside = [pid for pid in pids if _pid_namespace(pid) not in (None, own)]
        for pid in inside:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + KILL_TIMEOUT
        while any(_pid_alive(pid) for pid in inside) and time.monotonic() < deadline:
            time.sleep(0.05)
        _kill_cgroup(self.hierarchies, exec_cgroup)
        return len(pids)

    def console_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.console_log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    # -- commands inside --

    def _join_exec_cgroup(self) -> None:  # in the child, before exec
        for hierarchy in self.hierarchies:
            (hierarchy.mount / self.name / EXEC_CGROUP / "cgroup.procs").write_text("0")

    def command(self, args: Sequence[str], user: str | None = None) -> list[str]:
        """nsenter into every namespace of the container's PID 1, with a clean environment."""
        inner = ["env", "-i", f"PATH={CONTAINER_PATH}", "LANG=C.UTF-8", "HOME=/root",
                 "SYSTEMD_PAGER=cat", "SYSTEMD_COLORS=0"]
        if user is not None:
            inner += ["runuser", "-u", user, "--"]
        return ["nsenter", "--target", str(self.leader), "--all", *inner, *args]

    def run(
        self, args: Sequence[str], *, user: str | None = None, check: bool = True,
        timeout: float = 120.0, input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            self.command(args, user), input=input, capture_output=True, text=True,
            timeout=timeout, check=False, preexec_fn=self._join_exec_cgroup,
        )
        if check and result.returncode != 0:
            raise CommandFailed(
                f"in the container{f' as {user}' if user else ''}: {shlex.join(args)} "
                f"exited {result.returncode}\n--- stdout\n{result.stdout}\n"
                f"--- stderr\n{result.stderr}"
            )
        return result

    def popen(self, args: Sequence[str], *, user: str | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(self.command(args, user), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=self._join_exec_cgroup)

    def write_file(self, path: str, content: str, mode: int = 0o644) -> None:
        self.run(["sh", "-ec", f'mkdir -p "$(dirname {shlex.quote(path)})"; '
                 f"cat > {shlex.quote(path)}; chmod {mode:o} {shlex.quote(path)}"],
                 input=content)

    def copy_in(self, base: Path, names: Sequence[str], dest: str) -> None:
        """Copy files (paths relative to `base`, symlinks kept as links) to `dest` inside."""
        listing = "".join(f"{name}\0" for name in names)
        pack = subprocess.Popen(
            ["tar", "-C", str(base), "--null", "--files-from=-", "-cf", "-"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        assert pack.stdin is not None and pack.stdout is not None
        unpack = subprocess.Popen(
            self.command(["sh", "-ec", f"mkdir -p {shlex.quote(dest)}; "
                          f"tar -xf - -C {shlex.quote(dest)}"]),
            stdin=pack.stdout, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=self._join_exec_cgroup,
        )
        pack.stdout.close()
        pack.stdin.write(listing.encode())
        pack.stdin.close()
        _, unpacked_err = unpack.communicate(timeout=120)
        pack_err = pack.stderr.read() if pack.stderr is not None else b""
        pack.wait(timeout=120)
        if pack.returncode or unpack.returncode:
            raise CommandFailed(
                f"copying {len(names)} files from {base} to {dest} failed: "
                f"{pack_err.decode(errors='replace')}{unpacked_err.decode(errors='replace')}"
            )


def _pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                children += [int(c) for c in (task / "children").read_text().split()]
    return children
