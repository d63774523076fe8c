"""One table of config keys (kvprefetchd/config_keys/): the Config dataclass, the checks,
the restart set, the daemon's flags, systemd/config.example.toml and docs/configuration.md
all come from it, and these tests fail when any of them drifts from it (a key missing from
the example file or the docs, a flag added by hand, a generated file not regenerated)."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvprefetchd import cli
from kvprefetchd.config import RESTART_KEYS, Config, ConfigError, build_config, merge_reload
from kvprefetchd.config_keys import BY_NAME, KEYS, Key
from kvprefetchd.config_keys.__main__ import GENERATED, stale
from kvprefetchd.config_keys.key import (
    ADDRESS,
    BOOL,
    BY_ROOT,
    CHOICE,
    DERIVED,
    IDS,
    INT,
    MODELS,
    NAMES,
    PATH,
    ROOTS,
    SECONDS,
    SECONDS_OR_OFF,
    TEXT,
)
from kvprefetchd.config_keys.render import toml_value

REPO = Path(__file__).resolve().parents[2]
SETTABLE = [key for key in KEYS if key.settable]
# A commented-out setting of the example file: `# key = value` or a table header `# [name]`.
SETTING = re.compile(r'^# ((?:[A-Za-z_][\w-]*|"[^"]*") = .*|\[[\w.-]+\])$')


@pytest.mark.parametrize("name", sorted(GENERATED))
def test_the_generated_files_are_the_tables(name: str) -> None:
    path, render = GENERATED[name]
    assert path.read_text() == render(), (
        f"{path.relative_to(REPO)} drifted from the table of config keys: edit the table "
        "(daemon/kvprefetchd/config_keys/), then run python -m kvprefetchd.config_keys --write")
    assert stale() == [] or path not in stale()


def test_config_has_the_tables_fields_types_and_defaults() -> None:
    fields = dataclasses.fields(Config)
    assert [f.name for f in fields] == [key.name for key in KEYS]
    defaults = Config()
    for f in fields:
        key = BY_NAME[f.name]
        assert f.type == key.kind.annotation, f.name
        expected = key.default() if key.dynamic else key.default
        assert getattr(defaults, f.name) == expected, f.name
        assert type(getattr(defaults, f.name)) is type(expected), f.name


def uncommented_example() -> dict[str, Any]:
    text = (REPO / "systemd" / "config.example.toml").read_text()
    assert tomllib.loads(text) == {}  # as shipped, it changes nothing
    return tomllib.loads("\n".join(SETTING.sub(r"\1", line) for line in text.splitlines()))


def test_the_example_file_has_every_key_once_with_its_default() -> None:
    text = (REPO / "systemd" / "config.example.toml").read_text()
    values = uncommented_example()
    assert set(values) == {key.name for key in SETTABLE}, set(values) ^ {k.name for k in SETTABLE}
    top_level = text[:text.index("\n# [")]  # before the tables' examples
    for key in SETTABLE:
        if key.example:
            continue  # a table's example, not its (empty) default
        assert top_level.count(f"\n# {key.name} = ") == 1, key.name
        assert f"\n# {key.name} = {toml_value(key)}\n" in top_level, key.name
    # Each written default is the default the daemon takes (the socket is the chain's).
    written = {k: v for k, v in values.items() if not BY_NAME[k].example and k != "socket"}
    config = build_config(written, {})
    assert dataclasses.replace(config, socket=Config().socket) == Config()
    # The tables' examples are valid where their roots are.
    tables = {k: v for k, v in values.items() if BY_NAME[k].example}
    build_config({**tables, "roots": ["/mnt/kv", "/mnt/s3-kv"]}, {})


def docs_rows() -> dict[str, str]:
    text = (REPO / "docs" / "configuration.md").read_text()
    keys = text[text.index("## Keys"):]
    return {match[1]: match[0] for match in re.finditer(r"^\| `(\w+)` \|.*$", keys, re.M)}


def test_the_docs_have_a_row_per_key_with_its_bounds_and_reload() -> None:
    rows = docs_rows()
    assert set(rows) == {key.name for key in SETTABLE}, set(rows) ^ {k.name for k in SETTABLE}
    for key in SETTABLE:
        cells = [cell.strip() for cell in rows[key.name].split(" | ")]
        assert cells[4] == ("restart" if key.restart else "reload"), key.name
        assert cells[5] == (f"`{key.flag.name}`" if key.flag else ""), key.name
        for choice in key.choices:
            assert f"`{choice}`" in cells[3], key.name


def test_every_flag_is_a_keys_and_every_keys_flag_is_there() -> None:
    actions = {opt: action for action in cli.build_parser()._actions
               for opt in action.option_strings}
    expected = {key.flag.name: key for key in KEYS if key.flag}
    assert set(actions) - {"-h", "--help", "--config", "--version"} == set(expected)
    for flag, key in expected.items():
        action = actions[flag]
        assert action.dest == key.name, flag
        assert action.help and action.help.startswith(key.flag.help if key.flag else ""), flag
        if key.kind is CHOICE:
            assert tuple(action.choices or ()) == key.choices, flag
    docs = (REPO / "docs" / "configuration.md").read_text()
    for flag in [*expected, "--config", "--version"]:
        assert f"| `{flag}" in docs, flag


def test_flags_reach_their_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    args = cli.parse_args(["--workers", "3", "--engine", "pread", "--root", "/a", "--root", "/b",
                           "--tls-allowed-client", "x", "--metrics", "127.0.0.1:9"])
    assert (args.workers, args.engine, args.roots, args.tls_allowed_clients, args.metrics) == (
        3, "pread", ["/a", "/b"], ["x"], "127.0.0.1:9")


# ---- the checks follow each row ---------------------------------------------------------------

def other_value(key: Key) -> Any:
    """A valid value of the key that is not its default."""
    if key.kind is INT:
        assert key.bounds is not None
        low, high = (int(b) for b in key.bounds)
        return high if key.default != high else low
    if key.kind in (SECONDS, SECONDS_OR_OFF):
        assert key.bounds is not None
        return float(key.bounds[1])
    if key.kind is BOOL:
        return not key.default
    if key.kind is CHOICE:
        return next(c for c in key.choices if c != key.default)
    if key.kind is BY_ROOT:
        return {"/tmp/shared-kv": key.choices[-1]}
    return {TEXT: "127.0.0.1:7474", PATH: "/x.sock", ADDRESS: "127.0.0.1:9464",
            ROOTS: ("/a",), IDS: (7,), NAMES: ("router",), DERIVED: {"m": "advise"}}[key.kind]


def bad_values(key: Key) -> list[Any]:
    if key.kind is INT:
        assert key.bounds is not None
        low, high = (int(b) for b in key.bounds)
        return [low - 1, high + 1, "1", True, 1.0]
    if key.kind in (SECONDS, SECONDS_OR_OFF):
        assert key.bounds is not None
        least, most = key.bounds
        return [most * 2, -1, "1", True] + ([least / 2] if least > 0 else [])
    if key.kind is BOOL:
        return [1, "true"]
    if key.kind is CHOICE:
        return ["nope", 1]
    return {TEXT: [1], PATH: ["", 1], ADDRESS: ["nowhere", 1], ROOTS: ["/a", ["a"]],
            IDS: [[-1], "1"], NAMES: [[""], "a"], BY_ROOT: [{"/tmp/shared-kv": "nope"}, "x"],
            MODELS: [{"m": {}}, "x"]}[key.kind]


@pytest.mark.parametrize("key", SETTABLE, ids=[key.name for key in SETTABLE])
def test_each_key_takes_its_bounds_and_refuses_beyond_them(key: Key) -> None:
    for value in bad_values(key):
        with pytest.raises(ConfigError, match=rf"^{key.name}\b|^models"):
            build_config({key.name: value}, {})
    if key.kind is MODELS:
        return
    edges: list[Any] = [other_value(key)]
    if key.bounds is not None:
        edges += [type(key.default)(bound) for bound in key.bounds]
    for value in edges:
        if key.kind is TEXT:  # a TCP listener needs its TLS files or loopback plaintext
            continue
        if key.name == "read_bytes" and value > Config().max_read_bytes:
            continue  # read_bytes > max_read_bytes is refused, with read_bytes' name
        if key.name == "max_read_bytes" and value < Config().read_bytes:
            continue
        if key.name in ("max_frame_bytes", "max_input_buffer_bytes"):
            continue  # held to each other: tested in test_bounds.py
        got = getattr(build_config({key.name: value}, {}), key.name)
        assert got == (tuple(value) if isinstance(value, list) else value), key.name


def test_a_reload_holds_exactly_the_restart_keys() -> None:
    old = Config()
    assert {key.name for key in KEYS if key.restart} == RESTART_KEYS
    for key in KEYS:
        if key.kind is MODELS:
            continue
        new = dataclasses.replace(old, **{key.name: other_value(key)})
        merged, held = merge_reload(old, new)
        if key.restart:
            assert held == [key.name] and getattr(merged, key.name) == getattr(old, key.name)
        else:
            assert held == [] and getattr(merged, key.name) == getattr(new, key.name), key.name
