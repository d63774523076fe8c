"""Putting kvprefetchd into the container: one pluggable step.

An installation method puts the daemon, the units, the config and the `kvprefetchd`
account in place, and says where the client CLI is. Today there is one, the README's
"Install as a systemd service": `pip install ./clients/python .` from the checked-out tree
into a venv, then `kvprefetchd install-systemd`. A .deb (issue 15, item 4) will be a second
class with the same `install()`; the tests run against whichever the fixture picks.

What happens after any method is the same and lives in the tests: `systemctl
daemon-reload && systemctl enable --now kvprefetchd.socket`, as the README says.

The container has no network: the build and run dependencies are downloaded as wheels on
the host (`pip download`, for the container's Python: Debian 12's CPython 3.11 on
manylinux x86_64) and installed with --no-index --find-links.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from system_container import CommandFailed, Container

# The tree to install: this checkout, or another one (e.g. a branch with a fix, tested by
# this branch's system test) named by KVPREFETCH_SYSTEM_TREE.
TREE_ENV = "KVPREFETCH_SYSTEM_TREE"
REPO = Path(os.environ.get(TREE_ENV) or Path(__file__).resolve().parents[2])
SOCKET = "/run/kvprefetchd/kvprefetchd.sock"
CONFIG = "/etc/kvprefetchd/config.toml"


class WheelsUnavailable(RuntimeError):
    """The package index cannot be reached for the wheels the container needs."""


@dataclass(frozen=True)
class Installed:
    method: str  # how it got there, for the report
    client: str  # the `kvprefetch` CLI inside the container
    seconds: float
    python: str  # an interpreter inside that imports that client


class Installation(Protocol):
    """How kvprefetchd gets into the container (the README's pip path; later a .deb)."""

    name: str

    def prepare(self, work: Path) -> None:
        """On the host, before the container boots: fetch or build what install() copies in
        (the container has no network). Raises WheelsUnavailable (or the like) to skip."""

    def install(self, container: Container) -> Installed:
        """Put the daemon, the units, the config and the kvprefetchd account in place."""


# ---- the tree under test -------------------------------------------------------------------


def tree_files(repo: Path = REPO) -> list[str]:
    """The files of the checkout as a fresh clone would have them, plus uncommitted work:
    tracked and untracked-but-not-ignored files (no .venv, build/, caches)."""
    listed = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, check=True,
    ).stdout.decode().split("\0")
    # A tracked file deleted in the work tree is not part of what is being tested.
    return sorted(name for name in listed if name and os.path.lexists(repo / name))


def requirements(repo: Path = REPO) -> list[str]:
    """What `pip install ./clients/python .` needs: the build systems' requirements and the
    daemon's run-time ones (setup.py's, as the installed metadata lists them), less the
    client, which comes from the tree."""
    build = [*tomllib.loads((repo / "pyproject.toml").read_text())["build-system"]["requires"],
             *tomllib.loads((repo / "clients/python/pyproject.toml").read_text())
             ["build-system"]["requires"]]
    runtime = [r for r in importlib.metadata.requires("kvprefetchd") or []
               if "extra ==" not in r and not r.startswith("kvprefetch=")]
    return sorted(set(build)) + runtime


def download_wheels(dest: Path, log: Path) -> list[str]:
    """Binary wheels of requirements() for the container's Python, via the host's pip."""
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
        "--dest", str(dest), "--only-binary=:all:", "--implementation", "cp",
        "--python-version", "3.11", "--abi", "cp311", "--abi", "abi3", "--abi", "none",
        "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
        "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_12_x86_64",
        "--platform", "manylinux2010_x86_64", "--platform", "manylinux_2_5_x86_64",
        "--platform", "manylinux1_x86_64", "--platform", "any",
        *requirements(),
    ]
    with open(log, "ab") as output:
        result = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-10:]
        raise WheelsUnavailable(f"pip download failed (status {result.returncode}); end of "
                                f"{log}:\n" + "\n".join(tail))
    return sorted(p.name for p in dest.iterdir())


# ---- the README's way ----------------------------------------------------------------------


class PipInstall:
    """README: `pip install .` then `kvprefetchd install-systemd`, into a venv in /opt.

    A venv because Debian 12's pip refuses to install into the system Python (PEP 668),
    and /opt because the unit hides /home and /root (install.py warns about those).
    """

    name = ("pip install ./clients/python . (venv in /opt/kvprefetchd) + kvprefetchd "
            "install-systemd")
    venv = "/opt/kvprefetchd"
    source = "/root/src"
    wheels = "/root/wheels"

    def __init__(self, repo: Path = REPO) -> None:
        self.repo = repo
        self.wheel_dir: Path | None = None

    def prepare(self, work: Path) -> None:
        self.wheel_dir = work / "wheels"
        self.wheel_dir.mkdir()
        download_wheels(self.wheel_dir, work / "pip-download.log")

    def install(self, container: Container) -> Installed:
        assert self.wheel_dir is not None, "prepare() first"
        started = time.monotonic()
        container.copy_in(self.repo, tree_files(self.repo), self.source)
        container.copy_in(self.wheel_dir, sorted(os.listdir(self.wheel_dir)), self.wheels)
        container.run(["python3", "-m", "venv", self.venv])
        pip = [f"{self.venv}/bin/pip", "install", "--no-index", "--find-links", self.wheels,
               "--disable-pip-version-check", "--quiet"]
        container.run(["sh", "-ec", f"cd {self.source} && exec \"$@\"", "pip", *pip,
                       "./clients/python", "."],
                      timeout=600)
        result = container.run([f"{self.venv}/bin/kvprefetchd", "install-systemd"])
        expected = f"ExecStart={self.venv}/bin/kvprefetchd"
        if expected not in result.stdout:
            raise CommandFailed(f"install-systemd did not point the unit at the venv "
                                f"({expected}):\n{result.stdout}")
        return Installed(self.name, f"{self.venv}/bin/kvprefetch", time.monotonic() - started,
                         f"{self.venv}/bin/python")


class DebInstall:
    """README: `apt-get install ./kvprefetchd_VERSION_amd64.deb`, the package ./dev package
    builds (packaging/deb.py). Its dependencies are Debian's, in the container's tree
    (system_rootfs.PACKAGES), so apt needs no network. The postinst creates the user
    (sysusers.d) and enables and starts the socket."""

    name = "apt-get install ./kvprefetchd_VERSION_amd64.deb"
    directory = "/root/deb"

    def __init__(self, repo: Path = REPO) -> None:
        self.repo = repo
        self.deb: Path | None = None

    def prepare(self, work: Path) -> None:
        built = subprocess.run(
            [sys.executable, str(self.repo / "packaging" / "deb.py"), "--out", str(work / "deb")],
            capture_output=True, text=True, check=False, timeout=1200,
        )
        if built.returncode != 0:
            raise CommandFailed(f"packaging/deb.py failed:\n{built.stdout}\n{built.stderr}")
        (self.deb,) = (work / "deb").glob("kvprefetchd_*.deb")

    def install(self, container: Container) -> Installed:
        assert self.deb is not None, "prepare() first"
        started = time.monotonic()
        container.copy_in(self.deb.parent, [self.deb.name], self.directory)
        container.run(["env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y",
                       "-q", f"{self.directory}/{self.deb.name}"], timeout=600)
        return Installed(self.name.replace("VERSION", self.deb.name.split("_")[1]),
                         "/usr/bin/kvprefetch", time.monotonic() - started, "/usr/bin/python3")


# The methods `KVPREFETCH_SYSTEM_INSTALL` may name (default: the README's).
INSTALL_ENV = "KVPREFETCH_SYSTEM_INSTALL"
INSTALLATIONS: dict[str, type[Installation]] = {"pip": PipInstall, "deb": DebInstall}


def chosen_installation() -> Installation:
    name = os.environ.get(INSTALL_ENV) or "pip"
    if name not in INSTALLATIONS:
        raise ValueError(f"{INSTALL_ENV}={name}: not one of {', '.join(INSTALLATIONS)}")
    return INSTALLATIONS[name]()
