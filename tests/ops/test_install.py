"""`kvprefetchd install-systemd` into a staging prefix, and the units it installs.

The units are checked by systemd's own tools when they are installed here
(`systemd-analyze verify`, `systemd-analyze security --offline`), skipped otherwise.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvprefetchd import install
from kvprefetchd.config import Config, build_config

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "systemd"
EXPOSURE_LIMIT = 2.0


def run(*args: str) -> int:
    return install.main(list(args))


def service_of(prefix: Path) -> str:
    return (prefix / "etc/systemd/system/kvprefetchd.service").read_text()


# ---- installing --------------------------------------------------------------------------------


def test_install_puts_units_and_config_in_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("--prefix", str(tmp_path), "--no-user", "--bin", sys.executable) == 0
    service = service_of(tmp_path)
    assert re.search(
        rf"^ExecStart={re.escape(sys.executable)} --config /etc/kvprefetchd/config.toml$",
        service, re.MULTILINE,
    )
    # Everything but ExecStart= is the canonical file.
    canonical = (UNITS / "kvprefetchd.service").read_text()
    assert [line for line in service.splitlines() if not line.startswith("ExecStart=")] == [
        line for line in canonical.splitlines() if not line.startswith("ExecStart=")
    ]
    socket_unit = tmp_path / "etc/systemd/system/kvprefetchd.socket"
    assert socket_unit.read_text() == (UNITS / "kvprefetchd.socket").read_text()
    config = tmp_path / "etc/kvprefetchd/config.toml"
    assert config.read_text() == (UNITS / "config.example.toml").read_text()
    for path in (socket_unit, config):
        assert path.stat().st_mode & 0o777 == 0o644
    out = capsys.readouterr().out
    assert "installed" in out
    assert "systemctl daemon-reload && systemctl enable --now kvprefetchd.socket" in out


def test_a_second_run_keeps_the_operators_config_and_updates_the_units(tmp_path: Path) -> None:
    assert run("--prefix", str(tmp_path), "--no-user", "--bin", sys.executable) == 0
    config = tmp_path / "etc/kvprefetchd/config.toml"
    config.write_text('roots = ["/mnt/kv"]\n')
    other_bin = shutil.which("true") or "/bin/true"
    assert run("--prefix", str(tmp_path), "--no-user", "--bin", other_bin) == 0
    assert config.read_text() == 'roots = ["/mnt/kv"]\n'
    assert f"ExecStart={other_bin} --config" in service_of(tmp_path)


def test_dry_run_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("--prefix", str(tmp_path), "--dry-run", "--bin", sys.executable) == 0
    assert list(tmp_path.iterdir()) == []
    out = capsys.readouterr().out
    assert "(dry run)" in out
    if not install._user_exists(install.ACCOUNT):
        assert "useradd --system --no-create-home" in out
        assert "--shell /usr/sbin/nologin" in out


def test_the_default_bin_is_this_installations_script() -> None:
    found = install.default_bin()
    assert found.startswith("/")
    assert Path(found).name == "kvprefetchd"


@pytest.mark.parametrize("bad", ["/opt/kv%prefetchd", '/opt/"q"/kvprefetchd', "/opt/a\nb"])
def test_paths_systemd_would_reinterpret_are_refused(tmp_path: Path, bad: str) -> None:
    assert run("--prefix", str(tmp_path), "--no-user", "--bin", bad, "--dry-run") == 1


def test_a_missing_bin_is_refused_unless_dry_run(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope" / "kvprefetchd")
    assert run("--prefix", str(tmp_path / "p"), "--no-user", "--bin", missing) == 1
    assert not (tmp_path / "p").exists()


def test_render_service_keeps_prefixes_and_arguments() -> None:
    text = "[Service]\nExecStart=-/usr/local/bin/kvprefetchd --config /etc/x.toml\n"
    assert install.render_service(text, "/opt/kv prefetch/bin/kvprefetchd") == (
        '[Service]\nExecStart=-"/opt/kv prefetch/bin/kvprefetchd" --config /etc/x.toml\n'
    )
    with pytest.raises(install.InstallError):
        install.render_service("[Service]\n", "/usr/bin/kvprefetchd")


@pytest.mark.parametrize("group_exists", [False, True])
def test_the_account_is_created_with_useradd_system(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, group_exists: bool
) -> None:
    calls: list[list[str]] = []

    def fake_run(command: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(install, "_user_exists", lambda name: False)
    monkeypatch.setattr(install, "_group_exists", lambda name: group_exists)
    monkeypatch.setattr(install.os, "geteuid", lambda: 0)
    monkeypatch.setattr(install.shutil, "which", lambda name: f"/usr/sbin/{name}")
    monkeypatch.setattr(install.subprocess, "run", fake_run)
    assert run("--prefix", str(tmp_path), "--bin", sys.executable) == 0
    (command,) = calls
    assert command[:3] == ["useradd", "--system", "--no-create-home"]
    assert command[command.index("--shell") + 1] == "/usr/sbin/nologin"
    assert command[-1] == "kvprefetchd"
    if group_exists:
        assert command[-3:-1] == ["--gid", "kvprefetchd"]
    else:
        assert "--user-group" in command


def test_an_existing_account_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(install, "_user_exists", lambda name: True)
    monkeypatch.setattr(install.subprocess, "run", lambda *a, **k: pytest.fail("ran useradd"))
    assert run("--prefix", str(tmp_path), "--bin", sys.executable) == 0


def test_creating_the_account_needs_root(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(install, "_user_exists", lambda name: False)
    monkeypatch.setattr(install.os, "geteuid", lambda: 1000)
    assert run("--prefix", str(tmp_path), "--bin", sys.executable) == 1
    assert "--no-user" in capsys.readouterr().err


def test_the_unit_files_are_found_through_the_package() -> None:
    source = install.source_dir()
    assert (source / "kvprefetchd.service").samefile(UNITS / "kvprefetchd.service")


# ---- the units themselves --------------------------------------------------------------------


def unit_settings(path: Path) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_the_service_carries_the_promised_settings() -> None:
    service = unit_settings(UNITS / "kvprefetchd.service")
    for key, value in {
        "Type": "notify", "NotifyAccess": "main", "WatchdogSec": "30s",
        "ExecReload": "/bin/kill -HUP $MAINPID", "RuntimeDirectory": "kvprefetchd",
        "User": "kvprefetchd", "Group": "kvprefetchd", "ProtectSystem": "strict",
        "NoNewPrivileges": "yes", "CapabilityBoundingSet": "", "AmbientCapabilities": "",
        "SystemCallArchitectures": "native", "MemoryDenyWriteExecute": "yes",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6", "UMask": "0077",
        "IPAddressDeny": "any", "IPAddressAllow": "localhost", "DevicePolicy": "closed",
        "KillSignal": "SIGTERM", "TimeoutStopSec": "10s", "Restart": "on-failure",
        "LimitNOFILE": "20000", "RuntimeDirectoryPreserve": "yes",
    }.items():
        assert service[key] == [value], key
    assert "io_uring_setup io_uring_enter io_uring_register" in service["SystemCallFilter"][0]
    socket_unit = unit_settings(UNITS / "kvprefetchd.socket")
    assert socket_unit["ListenStream"] == ["/run/kvprefetchd/kvprefetchd.sock"]
    assert socket_unit["SocketMode"] == ["0660"]
    assert socket_unit["SocketGroup"] == ["kvprefetchd"]


def _installed_units(tmp_path: Path) -> Path:
    """The units as installed, with ExecStart= naming an executable that exists here."""
    binary = shutil.which("kvprefetchd") or str(Path(sys.executable).parent / "kvprefetchd")
    if not Path(binary).exists():
        binary = sys.executable
    assert run("--prefix", str(tmp_path), "--no-user", "--bin", binary) == 0
    return tmp_path / "etc/systemd/system"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not found")
def test_systemd_analyze_verify_accepts_both_units(tmp_path: Path) -> None:
    units = _installed_units(tmp_path)
    result = subprocess.run(
        ["systemd-analyze", "verify", str(units / "kvprefetchd.socket"),
         str(units / "kvprefetchd.service")],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    # Warnings (unknown keys, bad values) go to stderr without failing: none allowed.
    assert result.stderr.strip() == "", result.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not found")
def test_the_services_exposure_stays_at_or_below_the_target(tmp_path: Path) -> None:
    units = _installed_units(tmp_path)
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(units / "kvprefetchd.service")],
        capture_output=True, text=True, timeout=60, check=False,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    if match is None:
        pytest.skip(f"this systemd-analyze cannot score offline: {result.stderr.strip()}")
    assert float(match.group(1)) <= EXPOSURE_LIMIT, result.stdout


# ---- the example configuration ---------------------------------------------------------------

# A commented-out setting: `# key = value` or a table header `# [name]`; prose never
# has " = " right after its first word.
SETTING = re.compile(r'^# ((?:[A-Za-z_][\w-]*|"[^"]*") = .*|\[[\w.-]+\])$')


def uncommented_example() -> dict[str, Any]:
    text = (UNITS / "config.example.toml").read_text()
    return tomllib.loads("\n".join(SETTING.sub(r"\1", line) for line in text.splitlines()))


def test_the_example_config_changes_nothing_as_shipped() -> None:
    assert tomllib.loads((UNITS / "config.example.toml").read_text()) == {}


def test_the_example_config_documents_every_key_with_its_default() -> None:
    values = uncommented_example()
    # model_warm_modes is derived from each [models.NAME] table's warm_mode, not a key.
    fields = {f.name: f for f in dataclasses.fields(Config) if f.name != "model_warm_modes"}
    pending: set[str] = set()
    assert set(fields) <= set(values), set(fields) - set(values)
    assert set(values) <= set(fields) | pending, set(values) - set(fields)
    assert values["metrics"] == ""
    defaults = Config()
    for name, value in values.items():
        if name in ("socket", "models", "residency_by_root", "warm_extent_by_root") \
                or name in pending:
            continue  # environment-dependent, or an example table rather than a default
        default = getattr(defaults, name)
        assert (tuple(value) if isinstance(default, tuple) else value) == default, name


def test_the_example_model_profile_is_a_valid_profile() -> None:
    values = uncommented_example()
    config = build_config(
        {
            "roots": ["/mnt/kv"],
            "models": values["models"],
            "residency_by_root": values["residency_by_root"],
        },
        {},
    )
    profile = config.models["qwen3-8b"]
    assert profile.fingerprint == "07d7b166f256"
    assert config.residency_for("/mnt/kv") == "tier"
