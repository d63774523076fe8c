"""The kvprefetchd units inside the booted container, as an operator drives them.

Everything goes through systemctl, journalctl, systemd-analyze and the `kvprefetch` CLI in
the container, the way the README tells an operator to. `reset()` puts the units back
to "installed, socket listening, service stopped, shipped config, no drop-ins" so that
each test starts from what `kvprefetchd install-systemd` and `systemctl enable --now
kvprefetchd.socket` leave.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

from system_container import Container
from system_install import CONFIG, SOCKET, Installed

SERVICE = "kvprefetchd.service"
SOCKET_UNIT = "kvprefetchd.socket"
DROP_IN_DIR = "/etc/systemd/system/kvprefetchd.service.d"
MEMBER = "router"  # in group kvprefetchd: may connect (README: usermod -aG kvprefetchd ...)
OUTSIDER = "outsider"  # in no group of the daemon's
SHARED_ROOT = "/tmp/shared-kv"  # the shipped config's only root

T = TypeVar("T")

# Figures a test measured, printed in the run's summary (conftest.pytest_terminal_summary).
FIGURES: dict[str, str] = {}


class Service:
    def __init__(self, container: Container, installed: Installed) -> None:
        self.container = container
        self.installed = installed
        self.shipped_config = container.run(["cat", CONFIG]).stdout

    # -- systemd --

    def systemctl(self, *args: str, check: bool = True,
                  timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return self.container.run(["systemctl", *args], check=check, timeout=timeout)

    def show(self, *properties: str, unit: str = SERVICE) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in properties)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def main_pid(self) -> int:
        return int(self.show("MainPID")["MainPID"])

    def wait_for(self, probe: Callable[[], T | None], timeout: float, what: str) -> T:
        """Poll `probe` until it returns something other than None (or fail, saying `what`)."""
        deadline = time.monotonic() + timeout
        while True:
            found = probe()
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not within {timeout:.0f} s: {what}\n{self.describe()}"
                )
            time.sleep(0.25)

    def describe(self) -> str:
        """The units' state and the service's recent journal, for failure messages."""
        state = self.show("ActiveState", "SubState", "Result", "NRestarts", "MainPID",
                          "StatusText", "ExecMainStatus")
        socket = self.show("ActiveState", "SubState", "Result", unit=SOCKET_UNIT)
        journal = self.container.run(
            ["journalctl", "--no-pager", "--unit", SERVICE, "--lines", "25"], check=False,
        ).stdout
        return (f"{SERVICE}: {state}\n{SOCKET_UNIT}: {socket}\n"
                f"journalctl -u {SERVICE} (last 25 lines):\n{journal}")

    def drop_in(self, name: str, text: str) -> None:
        """A drop-in, as `systemctl edit kvprefetchd` would write it, then daemon-reload."""
        self.container.write_file(f"{DROP_IN_DIR}/{name}.conf", text)
        self.systemctl("daemon-reload")

    def write_config(self, extra: str) -> None:
        """The shipped config with `extra` TOML appended (top-level keys come first in it)."""
        self.container.write_file(CONFIG, self.shipped_config + "\n" + extra + "\n")

    def reset(self) -> None:
        self.systemctl("stop", SERVICE, check=False)
        self.container.run(["rm", "-rf", DROP_IN_DIR, SHARED_ROOT])
        self.container.write_file(CONFIG, self.shipped_config)
        self.systemctl("daemon-reload")
        self.systemctl("reset-failed", SERVICE, SOCKET_UNIT, check=False)
        self.systemctl("start", SOCKET_UNIT)

    # -- the journal --

    def cursor(self) -> str:
        """Where the journal ends now: later reads start after it."""
        out = self.container.run(["journalctl", "--lines=0", "--show-cursor", "--quiet"]).stdout
        match = re.search(r"-- cursor: (\S+)", out)
        assert match, f"journalctl printed no cursor: {out!r}"
        return match.group(1)

    def journal(self, after: str, *args: str) -> list[dict[str, str]]:
        """The service's journal entries after the cursor, as journalctl's JSON objects."""
        out = self.container.run([
            "journalctl", "--no-pager", "--unit", SERVICE, f"--after-cursor={after}",
            "--output=json", *args,
        ]).stdout
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    def wait_for_log(self, after: str, pattern: str, *args: str,
                     timeout: float = 10.0) -> dict[str, str]:
        """The first entry after the cursor whose MESSAGE matches; journald may lag a little."""
        regex = re.compile(pattern)

        def probe() -> dict[str, str] | None:
            for entry in self.journal(after, *args):
                if regex.search(str(entry.get("MESSAGE", ""))):
                    return entry
            return None

        extra = f" ({' '.join(args)})" if args else ""
        return self.wait_for(probe, timeout, f"a journal entry matching {pattern!r}{extra}")

    def messages(self, after: str, *args: str) -> list[str]:
        return [str(entry.get("MESSAGE", "")) for entry in self.journal(after, *args)]

    # -- the client --

    def client(self, *args: str, user: str = MEMBER, check: bool = True,
               timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """`kvprefetch --socket /run/kvprefetchd/kvprefetchd.sock ARGS` as `user`."""
        return self.container.run(
            [self.installed.client, "--socket", SOCKET, *args], user=user, check=check,
            timeout=timeout,
        )

    def ping(self, user: str = MEMBER) -> dict[str, object]:
        reply: dict[str, object] = json.loads(self.client("ping", "--json", user=user).stdout)
        return reply
