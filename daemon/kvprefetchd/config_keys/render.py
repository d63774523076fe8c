"""The files generated from the table of config keys: the dataclass's fields
(config_fields.py), the example file (systemd/config.example.toml) and the docs' key table
(docs/configuration.md). Pure functions of the table, so a test can compare each with the
file in the tree."""

from __future__ import annotations

import json
import textwrap
from typing import Any

from kvprefetchd import addresses
from kvprefetchd.config_keys import KEYS, SECTIONS, Key
from kvprefetchd.config_keys.key import BOOL, BY_ROOT, CHOICE, INT, MODELS, SECONDS_OR_OFF

GENERATED_BY = "python -m kvprefetchd.config_keys --write"
COMMENT_WIDTH = 90


# ---- config_fields.py ------------------------------------------------------------------------

def _python_default(key: Key) -> str:
    if key.dynamic:
        return f"field(default_factory={key.default.__name__})"
    if isinstance(key.default, dict):
        return "field(default_factory=dict)"
    if key.shown.startswith("0o"):
        return key.shown
    return _python(key.default)


def _python(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return "(" + "".join(f"{_python(v)}, " for v in value).removesuffix(" ") + ")"
    return repr(value)


def fields_module() -> str:
    """config_fields.py: the frozen dataclass Config extends (config.py adds its methods)."""
    factories = sorted({(k.default.__module__, k.default.__name__) for k in KEYS if k.dynamic})
    imports = sorted([*factories, ("kvprefetchd.kv", "Profile")])
    lines = [
        '"""The Config dataclass\'s fields, generated from the table of config keys',
        f"(kvprefetchd/config_keys/) by `{GENERATED_BY}`: do not edit.",
        "config.py's Config adds its methods; what each key means is in the table and in",
        'docs/configuration.md."""',
        "",
        "from __future__ import annotations",
        "",
        "from collections.abc import Mapping",
        "from dataclasses import dataclass, field",
        "",
        *(f"from {module} import {name}" for module, name in imports),
        "",
        "",
        "@dataclass(frozen=True)",
        "class ConfigFields:",
        '    """Every setting, with its default, in the table\'s order."""',
        "",
        *(f"    {k.name}: {k.kind.annotation} = {_python_default(k)}" for k in KEYS),
    ]
    return "\n".join(lines) + "\n"


# ---- systemd/config.example.toml -------------------------------------------------------------

TOML_HEADER = f"""\
# kvprefetchd configuration (TOML): every key of kvprefetchd.config.Config.
# Generated from the table of config keys (daemon/kvprefetchd/config_keys/) by
# `{GENERATED_BY}`: edit the table, not this file.
# docs/configuration.md has the same keys as a table.
#
# Each line below shows a key with its default, commented out: this file as
# shipped changes nothing. Uncomment and edit what you need. Unknown keys are
# errors, not ignored, so a typo fails at start with the key's name.
#
# Precedence: built-in defaults < this file < command-line flags.
# `systemctl reload kvprefetchd` (SIGHUP) re-reads this file; an invalid file is
# refused and the old configuration stays in force. Keys baked into the socket
# or the workers (socket, workers, engine, ...) take effect at the next restart.
#
# Under the shipped unit the daemon runs as user kvprefetchd with the file
# system read-only and /home hidden: every root must be readable by that user
# (see the drop-in examples at the top of kvprefetchd.service).
"""


def toml_value(key: Key) -> str:
    """The default as TOML writes it."""
    if key.shown:
        return key.shown
    return _toml(key.default)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def _comment(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        indent = line[: len(line) - len(line.lstrip())]
        wrapped = textwrap.wrap(line, COMMENT_WIDTH - 2, subsequent_indent=indent) or [""]
        out += [f"# {part}".rstrip() for part in wrapped]
    return out


def example_toml() -> str:
    lines = [TOML_HEADER.rstrip("\n")]
    for section in SECTIONS:
        lines += ["", f"# ---- {section.title} ".ljust(80, "-")]
        if section.help:
            lines += ["", *_comment(section.help)]
        for key in section.keys:
            if not key.settable:
                continue
            if key.help:
                lines += ["", *_comment(key.help)]
            if key.example:
                lines += [f"# {line}".rstrip() for line in key.example.splitlines()]
            else:
                lines.append(f"# {key.name} = {toml_value(key)}")
    return "\n".join(lines) + "\n"


# ---- docs/configuration.md -------------------------------------------------------------------

def _number(key: Key, value: float) -> str:
    if key.kind is not INT:
        return f"{value:g}"
    number = int(value)
    if key.shown.startswith("0o"):
        return oct(number) if number else "0"
    if "bytes" in key.name and number >= 1024 and number % 1024 == 0:
        for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
            number //= 1024
            if number < 1024 or number % 1024:
                return f"{number} {unit}"
    if number >= 1 << 16 and number & (number - 1) == 0:
        return f"2^{number.bit_length() - 1}"
    return f"{number:,}"


def bounds_text(key: Key) -> str:
    if key.choices:
        return ", ".join(f"`{c}`" for c in key.choices)
    if key.bounds is None:
        return ""
    low, high = (_number(key, b) for b in key.bounds)
    return f"0, or {low} to {high}" if key.kind is SECONDS_OR_OFF else f"{low} to {high}"


def _default_text(key: Key) -> str:
    if key.dynamic:
        return "[the socket chain](#the-default-socket)"
    if key.kind in (BY_ROOT, MODELS):
        return "none"
    shown = f"`{toml_value(key)}`"
    if key.kind is INT and "bytes" in key.name and key.default >= 1024:
        shown += f" ({_number(key, key.default)})"
    return shown


def _cell(text: str) -> str:
    parts, listed = [], False  # indented lines (a list) each start a line, and what follows
    for line in text.splitlines():
        parts.append(("<br>" if line.startswith(" ") or listed else "") + line.strip())
        listed = line.startswith(" ")
    return " ".join(parts).replace("|", "\\|").replace(" <br>", "<br>")


MARKDOWN_HEADER = f"""\
# Configuration

<!-- Generated from the table of config keys (daemon/kvprefetchd/config_keys/) by
`{GENERATED_BY}`: edit the table, then run it.
tests/unit/test_config_keys.py fails when this file, systemd/config.example.toml
or the daemon's flags drift from the table. -->

kvprefetchd needs no configuration: every key below has a default. A TOML file
(`--config FILE`; the shipped unit reads `/etc/kvprefetchd/config.toml`, whose commented
template is [systemd/config.example.toml](../systemd/config.example.toml)) overrides the
defaults, an environment variable named below overrides the file, and a flag overrides
both. Unknown keys are errors, so a typo fails at start with the key's name.

`systemctl reload kvprefetchd` (SIGHUP) re-reads the file. An invalid file is refused and
the old configuration stays in force; a key marked *restart* keeps its old value (the
log names it) until the next restart, since it is baked into the socket or the workers.

## The default socket

When no `socket` is configured, the daemon listens on the first of:

1. `${addresses.SOCKET_ENV}`, if set and not empty, as given;
2. `{addresses.SYSTEMD_SOCKET}`, if it exists (a daemon under the shipped systemd units,
   whose `RuntimeDirectory=kvprefetchd` and `kvprefetchd.socket` put it there);
3. `{addresses.SOCKET_NAME}` in `$RUNTIME_DIRECTORY`, then in `$XDG_RUNTIME_DIR`: the first
   variable whose first entry (the text before any `:`) is an absolute path;
4. `{addresses.FALLBACK_SOCKET}`.

The clients find the daemon by the same chain (`kvprefetch.protocol.default_socket()` in
Python, `kvprefetch.DefaultSocket()` in Go): a daemon and a client started with no flags
meet. The systemd path comes before the runtime directories because a client run from
another service has a `$RUNTIME_DIRECTORY` of its own; a daemon started by hand beside
the systemd one is refused on the socket in use rather than listening where no client
looks. `clients/go/testdata/default_socket.json` holds the daemon and both clients to it.
"""


def flags_markdown() -> list[str]:
    lines = ["## Flags", "", "| flag | key | what it does |", "|---|---|---|",
             "| `--config FILE` | | the TOML file to read |"]
    for key in KEYS:
        if key.flag is None:
            continue
        metavar = f" {key.flag.metavar}" if key.flag.metavar else ""
        if key.kind is CHOICE:
            metavar = " {" + ",".join(key.choices) + "}"
        env = f" (also `${key.env}`, which the flag overrides)" if key.env else ""
        lines.append(f"| `{key.flag.name}{metavar}` | `{key.name}` | {_cell(key.flag.help)}{env} |")
    lines += ["| `--version` | | print the version and exit |", ""]
    return lines


def configuration_markdown() -> str:
    lines = [MARKDOWN_HEADER.rstrip("\n"), "", *flags_markdown(), "## Keys", ""]
    for section in SECTIONS:
        lines += [f"### {section.title[:1].upper()}{section.title[1:]}", ""]
        if section.help:
            lines += [_cell(section.help), ""]
        lines += ["| key | type | default | bounds | on reload | flag | what it does |",
                  "|---|---|---|---|---|---|---|"]
        group = ""
        for key in section.keys:
            if not key.settable:
                continue
            group = key.name if key.help else group
            about = _cell(key.help) if key.help else f"with `{group}` above"
            flag = f"`{key.flag.name}`" if key.flag else ""
            kind = "boolean" if key.kind is BOOL else key.kind.doc
            lines.append(f"| `{key.name}` | {kind} | {_default_text(key)} | {bounds_text(key)} | "
                         f"{'restart' if key.restart else 'reload'} | {flag} | {about} |")
        lines.append("")
        for key in section.keys:
            if key.example:
                lines += [f"`{key.name}`, for example:", "", "```toml", key.example, "```", ""]
    return "\n".join(lines)
