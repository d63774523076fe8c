"""`kvprefetchd install-systemd`: put the units, the example config and the user in place.

    kvprefetchd install-systemd [--prefix DIR] [--dry-run] [--no-user] [--bin PATH]

- PREFIX/etc/systemd/system/kvprefetchd.{service,socket}, with the service's
  ExecStart= pointing at --bin (default: the `kvprefetchd` script beside the
  running interpreter, i.e. this installation's);
- PREFIX/etc/kvprefetchd/config.toml from the example, only if absent (an
  operator's config is never overwritten);
- the system user and group `kvprefetchd` (useradd --system), unless --no-user
  or they exist already.

--prefix is a staging root, like DESTDIR: files land beneath it, but the paths
written inside them are the final ones (/etc/kvprefetchd/config.toml), so a
package build or an image build can stage them.

Where the files come from. The canonical copies live in the repository's
`systemd/` directory, one copy only. The package reaches them as package data
at `kvprefetchd/data/systemd`, which in the source tree is a symlink to
`../../../systemd`: an editable install (or a run from the checkout) reads the
canonical files through it, and a wheel build copies the files the symlink
points at (setuptools follows it; needs `[tool.setuptools.package-data]
kvprefetchd = ["data/systemd/*"]` in pyproject.toml). Should the symlink be
missing (a checkout without symlinks), the checkout's `systemd/` is used directly.
"""

from __future__ import annotations

import argparse
import grp
import importlib.resources
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

SERVICE = "kvprefetchd.service"
SOCKET = "kvprefetchd.socket"
EXAMPLE_CONFIG = "config.example.toml"
UNIT_DIR = "etc/systemd/system"
CONFIG_PATH = "etc/kvprefetchd/config.toml"
ACCOUNT = "kvprefetchd"  # user and group; the units' User=, Group=, SocketGroup=
NOLOGIN = "/usr/sbin/nologin"
# Hidden or read-only for the service (ProtectHome=yes): an executable there cannot start.
_HIDDEN_FROM_SERVICE = ("/home/", "/root/", "/run/user/")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class InstallError(RuntimeError):
    """Something the operator must fix; the message says what."""


# ---- finding the files ------------------------------------------------------------------------


def source_dir() -> Path:
    """The directory holding the units and the example config (see the module docstring)."""
    candidates: list[Path] = []
    try:
        packaged = importlib.resources.files("kvprefetchd").joinpath("data", "systemd")
        candidates.append(Path(str(packaged)))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - a zipped or odd install
        pass
    candidates.append(Path(__file__).resolve().parent.parent.parent / "systemd")
    for candidate in candidates:
        if all((candidate / name).is_file() for name in (SERVICE, SOCKET, EXAMPLE_CONFIG)):
            return candidate
    raise InstallError(
        "cannot find the unit files: looked in "
        + ", ".join(str(c) for c in candidates)
        + " (a wheel needs package-data kvprefetchd = [\"data/systemd/*\"])"
    )


def default_bin() -> str:
    """This installation's `kvprefetchd` script: beside sys.executable, else on $PATH."""
    beside = Path(sys.executable).parent / "kvprefetchd"  # not resolved: keep the venv's path
    if os.access(beside, os.X_OK):
        return str(beside.absolute())
    found = shutil.which("kvprefetchd")
    if found:
        return os.path.abspath(found)
    raise InstallError("cannot find the kvprefetchd executable; say where with --bin PATH")


# ---- rendering ----------------------------------------------------------------------------------

_EXEC_START = re.compile(r"^ExecStart=([-@:+!]*)(\S+)(.*)$", re.MULTILINE)


def render_service(text: str, executable: str) -> str:
    """The service unit with its ExecStart= executable replaced (arguments kept)."""
    if not executable.startswith("/"):
        raise InstallError(f"--bin {executable}: systemd needs an absolute path")
    if any(c in executable for c in "\n\"'\\%$"):
        raise InstallError(f"--bin {executable!r}: refusing a path systemd would reinterpret")
    quoted = f'"{executable}"' if any(c.isspace() for c in executable) else executable
    rendered, count = _EXEC_START.subn(
        lambda m: f"ExecStart={m.group(1)}{quoted}{m.group(3)}", text, count=1
    )
    if count != 1:
        raise InstallError(f"{SERVICE}: no ExecStart= line to rewrite")
    return rendered


# ---- doing it -----------------------------------------------------------------------------------


class Installer:
    def __init__(self, prefix: Path, dry_run: bool) -> None:
        self.prefix = prefix
        self.dry_run = dry_run

    def say(self, verb: str, what: str) -> None:
        print(("(dry run) " if self.dry_run else "") + f"{verb:<10} {what}")

    def target(self, relative: str) -> Path:
        return self.prefix / relative

    def write(self, path: Path, content: str, *, overwrite: bool, note: str = "") -> str:
        """Write `content` (0644) atomically; returns installed, updated, unchanged or kept."""
        suffix = f" ({note})" if note else ""
        if path.exists():
            if not overwrite:
                self.say("kept", f"{path} (exists; not overwritten)")
                return "kept"
            if path.read_text() == content:
                self.say("unchanged", f"{path}{suffix}")
                return "unchanged"
            verb = "updated"
        else:
            verb = "installed"
        if not self.dry_run:
            path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            try:
                with os.fdopen(fd, "w") as handle:
                    handle.write(content)
                os.chmod(temporary, 0o644)
                os.replace(temporary, path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        self.say(verb, f"{path}{suffix}")
        return verb

    def ensure_account(self) -> None:
        """The system user and group `kvprefetchd`, as Debian's adduser --system would make them."""
        if _user_exists(ACCOUNT):
            self.say("exists", f"user {ACCOUNT}")
            return
        command = ["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                   "--shell", NOLOGIN, "--comment", "kvprefetchd KV-cache prefetch daemon"]
        # useradd --user-group fails if the group exists already: join it instead.
        command += ["--gid", ACCOUNT] if _group_exists(ACCOUNT) else ["--user-group"]
        command.append(ACCOUNT)
        if self.dry_run:
            self.say("would run", shlex.join(command))
            return
        if os.geteuid() != 0:
            raise InstallError(
                f"creating user {ACCOUNT} needs root: run as root, or pass --no-user and "
                f"create it yourself ({shlex.join(command)})"
            )
        if shutil.which("useradd") is None:
            raise InstallError(f"useradd not found: create user and group {ACCOUNT} yourself")
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise InstallError(f"{shlex.join(command)} failed: {result.stderr.strip()}")
        self.say("created", f"user and group {ACCOUNT} ({shlex.join(command)})")


def _user_exists(name: str) -> bool:
    return _known(pwd.getpwnam, name)


def _group_exists(name: str) -> bool:
    return _known(grp.getgrnam, name)


def _known(lookup: Callable[[str], object], name: str) -> bool:
    try:
        lookup(name)
    except KeyError:
        return False
    return True


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvprefetchd install-systemd",
        description="Install the systemd units, the example configuration and the "
        "kvprefetchd system user.",
    )
    parser.add_argument(
        "--prefix", metavar="DIR", default="/",
        help="staging root, like DESTDIR: files go to DIR/etc/... (default: /)",
    )
    parser.add_argument("--dry-run", action="store_true", help="say what would be done; do nothing")
    parser.add_argument(
        "--no-user", action="store_true", help=f"do not create the {ACCOUNT} user and group"
    )
    parser.add_argument(
        "--bin", metavar="PATH",
        help="the kvprefetchd executable for ExecStart= (default: this installation's)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    installer = Installer(Path(args.prefix), args.dry_run)
    try:
        source = source_dir()
        executable = os.path.abspath(args.bin) if args.bin else default_bin()
        if not os.access(executable, os.X_OK):
            message = f"--bin {executable}: not an executable file"
            if not args.dry_run:
                raise InstallError(message)
            print(f"warning: {message}", file=sys.stderr)
        if executable.startswith(_HIDDEN_FROM_SERVICE):
            print(
                f"warning: {executable} is under a directory the unit hides (ProtectHome=yes); "
                "install kvprefetchd elsewhere (e.g. a venv in /opt) or relax it in a drop-in",
                file=sys.stderr,
            )
        service = render_service((source / SERVICE).read_text(), executable)
        installer.write(
            installer.target(UNIT_DIR) / SERVICE, service, overwrite=True,
            note=f"ExecStart={executable}",
        )
        installer.write(
            installer.target(UNIT_DIR) / SOCKET, (source / SOCKET).read_text(), overwrite=True
        )
        installer.write(
            installer.target(CONFIG_PATH), (source / EXAMPLE_CONFIG).read_text(),
            overwrite=False,
        )
        if args.no_user:
            if not _group_exists(ACCOUNT):
                print(
                    f"warning: group {ACCOUNT} does not exist; kvprefetchd.socket "
                    "(SocketGroup=) and the service (User=, Group=) need it",
                    file=sys.stderr,
                )
        else:
            installer.ensure_account()
    except (InstallError, OSError) as error:
        print(f"kvprefetchd install-systemd: {error}", file=sys.stderr)
        return EXIT_FAILED
    print()
    print("next:")
    print(f"  edit {Path('/') / CONFIG_PATH} (roots = the connector's shared_storage_path)")
    print(f"  usermod -aG {ACCOUNT} ROUTER_USER     # who may connect to the socket")
    print("  systemctl daemon-reload && systemctl enable --now kvprefetchd.socket")
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
