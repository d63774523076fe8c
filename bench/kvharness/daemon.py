"""The real daemon in a child process: started from a command line or a config file.

It is the console entry point (`python -m kvprefetchd`) with real forked workers; its
stdout and stderr go to a log file, it is waited for until it answers `ping`, and it
is stopped with a signal (killed when it does not exit in time), so no test or
benchmark leaves one behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from kvharness.wire import RawConnection

READY_TIMEOUT = 30.0


def command(*args: str) -> list[str]:
    """The daemon's command line, run by this interpreter (so by this venv's install)."""
    return [sys.executable, "-m", "kvprefetchd", *args]


def toml_value(value: Any) -> str:
    """A Python value as TOML: strings, numbers, booleans, lists and (inline) tables."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return json.dumps(value)  # a JSON string or number is a TOML basic string or number
    if isinstance(value, Path):
        return json.dumps(str(value))
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}"
                                for k, v in value.items()) + " }"
    if isinstance(value, Sequence):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def write_config(path: Path, settings: Mapping[str, Any]) -> Path:
    """A config file of top-level keys (docs/configuration.md), one line each."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{key} = {toml_value(value)}\n" for key, value in settings.items()))
    return path


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far, every thread included (psutil)."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


@dataclass
class Daemon:
    socket_path: str
    root: Path
    process: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)

    def connect(self, timeout: float | None = 30.0) -> RawConnection:
        return RawConnection(self.socket_path, timeout)

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request on a fresh connection; the reply, an error reply too."""
        with self.connect() as connection:
            return connection.call(op, **fields)

    def stats(self) -> dict[str, Any]:
        with self.connect() as connection:
            stats: dict[str, Any] = connection.call_ok("stats")["stats"]
            return stats

    def worker_pids(self) -> list[int]:
        return [int(w["pid"]) for w in self.stats()["workers"]]

    def cpu(self, worker_pids: Sequence[int] | None = None) -> tuple[float, float]:
        """(workers, supervisor) CPU seconds so far. worker_pids: as already known, so a
        measurement does not cost the supervisor a `stats` (default: asked now)."""
        pids = self.worker_pids() if worker_pids is None else worker_pids
        return sum(cpu_seconds(pid) for pid in pids), cpu_seconds(self.process.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> dict[str, Any]:
        """Poll `ping` until it answers; its reply. Raises with the log's tail otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvprefetchd exited with {self.process.returncode}:\n"
                                   f"{self.log()[-4000:]}")
            with contextlib.suppress(OSError):
                reply = self.call("ping")
                if reply.get("ok"):
                    return reply
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"kvprefetchd did not answer in {timeout:.0f} s:\n"
                                   f"{self.log()[-4000:]}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Signal it and wait; killed when it has not exited by then. Its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return self.kill()

    def kill(self) -> int:
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait(10)


def launch(args: Sequence[str], *, socket_path: str | Path, root: Path, log_path: Path,
           env: Mapping[str, str] | None = None, wait: bool = True,
           new_session: bool = False, wrapper: Sequence[str] = (),
           stderr: int | None = None) -> Daemon:
    """The daemon with these arguments, its output in log_path; ready unless wait=False.

    env: extra variables on top of this process's environment. new_session: out of
    our process group, so a Ctrl-C meant for a benchmark reaches the daemon only as
    the benchmark's orderly stop. wrapper: a command the daemon's command line is
    appended to (one that sets up a sandbox and execs it). stderr: an fd to give the
    daemon as its stderr instead of the log file (a pipe, a journal-like socket).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:  # the child keeps its own copy of the fd
        process = subprocess.Popen([*wrapper, *command(*args)], stdout=log,
                                   stderr=subprocess.STDOUT if stderr is None else stderr,
                                   env={**os.environ, **env} if env else None,
                                   start_new_session=new_session)
    daemon = Daemon(str(socket_path), root, process, log_path, list(args))
    if wait:
        daemon.wait_ready()
    return daemon


def start_cli(workdir: Path, *args: str, root: Path | None = None, wait: bool = True,
              env: Mapping[str, str] | None = None,
              settings: Mapping[str, Any] | None = None) -> Daemon:
    """A daemon configured by its command line in workdir: socket in workdir/run, root
    workdir/kv (made), log workdir/daemon.log, debug logging, 2 workers unless args say.
    settings: config keys without a flag (dedup_ttl_ms=0, ...), written to
    workdir/cli.toml and given as --config (flags override it)."""
    root = root or workdir / "kv"
    root.mkdir(parents=True, exist_ok=True)
    socket_path = workdir / "run" / "kvprefetchd.sock"
    full = ["--socket", str(socket_path), "--root", str(root), "--log-level", "debug", *args]
    if settings:
        if "--config" in args:
            raise ValueError("settings= writes the config file: put its keys there")
        full += ["--config", str(write_config(workdir / "cli.toml", settings))]
    if "--workers" not in args:
        full += ["--workers", "2"]
    return launch(full, socket_path=socket_path, root=root, log_path=workdir / "daemon.log",
                  env=env, wait=wait)


def start_config(workdir: Path, settings: Mapping[str, Any], *, name: str = "kvprefetchd",
                 log_path: Path | None = None, env: Mapping[str, str] | None = None,
                 wait: bool = True, new_session: bool = False) -> Daemon:
    """A daemon configured by a file workdir/<name>.toml holding settings (which name
    its `roots`; the first is the daemon's root here), its socket workdir/<name>.sock
    unless settings say, logging at warning unless they say."""
    full: dict[str, Any] = {"socket": str(workdir / f"{name}.sock"), "log_level": "warning",
                            **settings}
    config = write_config(workdir / f"{name}.toml", full)
    return launch(["--config", str(config)], socket_path=full["socket"],
                  root=Path(full["roots"][0]), log_path=log_path or workdir / f"{name}.log",
                  env=env, wait=wait, new_session=new_session)


def start_on(workdir: Path, root: Path, **settings: Any) -> Daemon:
    """start_config on one root (settings may name `roots` instead) with 2 workers unless
    settings say: the daemon most integration tests want, configured by key."""
    return start_config(workdir, {"roots": [str(root)], "workers": 2, **settings})
