"""`kvprefetchd --help` is the operator's manual page: every flag documented, the
install-systemd command and the environment variables named."""

from __future__ import annotations

import subprocess
import sys

from kvprefetchd.addresses import SOCKET_CHAIN
from kvprefetchd.config_keys import KEYS


def help_text() -> str:
    return subprocess.run([sys.executable, "-m", "kvprefetchd", "--help"], capture_output=True,
                          text=True, check=True, timeout=60).stdout


def test_help_documents_every_flag_the_command_and_the_environment() -> None:
    text = help_text()
    options = text[text.index("options:"):text.index("commands:")]
    flags = [word for line in options.splitlines() for word in line.split()
             if word.startswith("--")]
    assert {"--config", "--socket", "--root", "--workers", "--engine", "--warm-mode",
            "--read-bytes", "--metrics", "--log-level", "--version"} <= set(flags)
    # every flag's line (or the line after it) has words of explanation, not just its name
    lines = options.splitlines()
    for index, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("--") and stripped not in ("--help",):
            described = stripped.split("  ", 1)[-1].strip() != stripped or (
                index + 1 < len(lines) and lines[index + 1].startswith(" " * 10))
            assert described, f"undocumented: {stripped}"
    assert "install-systemd" in text
    for variable in ("KVPREFETCHD_METRICS", "KVPREFETCHD_SOCKET", "RUNTIME_DIRECTORY",
                     "XDG_RUNTIME_DIR", "NOTIFY_SOCKET", "JOURNAL_STREAM"):
        assert variable in text, variable
    # the default socket's chain, as the daemon resolves it (kvprefetchd.addresses)
    chain = " ".join(text[text.index("The default socket:"):].split())
    assert chain.startswith(" ".join(f"The default socket: {SOCKET_CHAIN}.".split()))


def test_every_config_key_with_a_flag_is_in_the_help() -> None:
    text = help_text()
    for key in KEYS:
        if key.flag is not None:
            assert key.flag.name in text, key.name
