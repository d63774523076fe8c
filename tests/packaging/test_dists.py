"""The distributions as a user gets them: built from the sdists, installed into a fresh venv.

packaging/build_dists.py builds both sdists, the wheels from those sdists, and repairs the
daemon's wheel with auditwheel; these tests install the two wheels into a new venv (no
editable install, no tree on sys.path) and use them: versions, the systemd installer's
dry run, and one file warmed through the installed daemon by the installed CLI.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvprefetch
import kvprefetchd

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "packaging" / "build_dists.py"


def run(*argv: str | Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                          check=True, timeout=600, **kwargs)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    made = json.loads(run(sys.executable, BUILD, "--out", out).stdout)
    return {name: Path(path) for name, path in made.items()}


@pytest.fixture(scope="module")
def venv(dists: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the two wheels and their dependencies, nothing of this tree."""
    where = tmp_path_factory.mktemp("venv") / "venv"
    run(sys.executable, "-m", "venv", where)
    run(where / "bin" / "python", "-m", "pip", "install", "-q",
        dists["client_wheel"], dists["daemon_wheel"])
    return where


def test_one_version_everywhere(dists: dict[str, Path]) -> None:
    assert kvprefetch.__version__ == kvprefetchd.__version__
    for path in dists.values():
        assert f"-{kvprefetchd.__version__}" in path.name, path.name


def test_the_daemon_wheel_is_abi3_manylinux_and_carries_its_liburing(
    dists: dict[str, Path],
) -> None:
    wheel = dists["daemon_wheel"]
    assert re.search(r"-cp311-abi3-manylinux_2_\d+_x86_64\.whl$", wheel.name), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvprefetchd/_native.abi3.so" in names
    assert any(re.match(r"kvprefetchd\.libs/liburing-[0-9a-f]+\.so", n) for n in names), names
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert not any(n.startswith("kvprefetch/") for n in names)  # the client is its own
    metadata = zipfile.ZipFile(wheel).read(
        f"kvprefetchd-{kvprefetchd.__version__}.dist-info/METADATA").decode()
    assert f"Requires-Dist: kvprefetch=={kvprefetchd.__version__}" in metadata


def test_the_client_wheel_is_pure_typed_and_needs_only_msgpack(dists: dict[str, Path]) -> None:
    wheel = dists["client_wheel"]
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    assert "kvprefetch/py.typed" in names and not any(n.endswith(".so") for n in names)
    assert any(n.endswith("licenses/LICENSE") for n in names)
    metadata = archive.read(f"kvprefetch-{kvprefetch.__version__}.dist-info/METADATA").decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert [r.split()[1].split(">")[0] for r in requires] == ["msgpack"], requires


def test_the_installed_native_module_loads_the_bundled_liburing(venv: Path) -> None:
    probe = run(venv / "bin" / "python", "-c",
                "import kvprefetchd._native as n, sys; print(n.__file__)",
                cwd="/").stdout.strip()
    assert probe.startswith(str(venv)), probe  # the installed copy, not this tree's
    needed = run("ldd", probe).stdout
    liburing = next(line for line in needed.splitlines() if "liburing" in line)
    assert "kvprefetchd.libs" in liburing, needed


def test_the_installed_commands_say_their_version_and_plan_the_units(venv: Path) -> None:
    version = kvprefetchd.__version__
    assert run(venv / "bin" / "kvprefetchd", "--version").stdout.strip() == f"kvprefetchd {version}"
    assert run(venv / "bin" / "kvprefetch", "--version").stdout.strip() == f"kvprefetch {version}"
    plan = run(venv / "bin" / "kvprefetchd", "install-systemd", "--dry-run").stdout
    assert "kvprefetchd.service" in plan and "kvprefetchd.socket" in plan, plan
    assert str(venv / "bin" / "kvprefetchd") in plan, plan  # ExecStart= is this install's


@pytest.fixture
def installed_daemon(venv: Path, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    root, sock = tmp_path / "kv", tmp_path / "kvprefetchd.sock"
    root.mkdir()
    daemon = subprocess.Popen([venv / "bin" / "kvprefetchd", "--root", str(root),
                               "--socket", str(sock), "--workers", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd="/")
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert daemon.poll() is None, daemon.stderr.read() if daemon.stderr else ""
            assert time.monotonic() < deadline, "the installed daemon never listened"
            time.sleep(0.05)
        yield root, sock
    finally:
        daemon.terminate()
        daemon.wait(10)
        if daemon.stderr:
            daemon.stderr.close()


def test_the_installed_cli_warms_a_file_through_the_installed_daemon(
    venv: Path, installed_daemon: tuple[Path, Path]
) -> None:
    root, sock = installed_daemon
    block = root / "block.bin"
    block.write_bytes(os.urandom(1 << 20))
    with open(block, "rb") as cold:
        os.posix_fadvise(cold.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    out = run(venv / "bin" / "kvprefetch", "--socket", sock, "warm", "--wait", "--json",
              block, cwd="/").stdout
    reply = json.loads(out)
    outcomes = reply.get("outcomes", reply)
    assert sum(outcomes.get(k, 0) for k in ("read", "resident")) == 1, reply


def test_a_build_without_liburing_says_so_loudly() -> None:
    """CC=false: the probe's link against -luring fails, as on a machine without it."""
    done = subprocess.run(
        [sys.executable, "-c", "import runpy; runpy.run_path('native/build_native.py')"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "CC": "false"},
    )
    assert done.returncode == 0, done.stderr
    assert "liburing NOT FOUND" in done.stderr and "WITHOUT the io_uring engine" in done.stderr
