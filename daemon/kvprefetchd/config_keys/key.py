"""What one row of the config-key table says, and the kinds of value a key may hold.

A key is written once, in its section's table (config_keys/*.py): the Config dataclass
(config_fields.py), the checks and the restart set (config.py), the daemon's flags
(cli.py), systemd/config.example.toml and docs/configuration.md all come from the rows.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True)
class Kind:
    """A kind of value: how config.py checks it, its Python type and its docs' name."""

    name: str
    annotation: str  # as config_fields.py declares the field
    doc: str  # the type column of docs/configuration.md


INT = Kind("int", "int", "integer")
SECONDS = Kind("seconds", "float", "seconds")
SECONDS_OR_OFF = Kind("seconds_or_off", "float", "seconds, 0 off")
BOOL = Kind("bool", "bool", "boolean")
CHOICE = Kind("choice", "str", "string")
TEXT = Kind("text", "str", "string")  # any string, "" included
PATH = Kind("path", "str", "path")  # a non-empty string
ADDRESS = Kind("address", "str", "address")  # metrics: "" or addresses.parse_metrics_address
ROOTS = Kind("roots", "tuple[str, ...]", "array of paths")
IDS = Kind("ids", "tuple[int, ...]", "array of integers")
NAMES = Kind("names", "tuple[str, ...]", "array of strings")
BY_ROOT = Kind("by_root", "Mapping[str, str]", "table")
MODELS = Kind("models", "Mapping[str, Profile]", "tables")
# Not a key: a field config.py fills from other keys' values (model_warm_modes).
DERIVED = Kind("derived", "Mapping[str, str]", "")

LISTS = (ROOTS, IDS, NAMES)  # a flag for one of them is repeatable


@dataclass(frozen=True)
class Flag:
    """The daemon's command-line flag for a key (it overrides the file)."""

    name: str  # "--read-bytes"
    help: str
    metavar: str | None = None


@dataclass(frozen=True)
class Key:
    """One config key. `help` is its paragraph in the example file and the docs; a key
    whose help is empty shares the paragraph of the key above it."""

    name: str
    kind: Kind
    # The default: a value, or a function of no arguments (called per Config: the socket).
    default: Any
    help: str = ""
    bounds: tuple[float, float] | None = None  # inclusive; SECONDS_OR_OFF: besides 0
    choices: tuple[str, ...] = ()  # CHOICE and BY_ROOT
    restart: bool = False  # a reload (SIGHUP) keeps the old value; a restart applies it
    flag: Flag | None = None
    env: str = ""  # an environment variable that overrides the file, below the flag
    shown: str = ""  # the default as the example file writes it, when not its TOML form
    example: str = ""  # a table's commented example, instead of `key = default`

    def __post_init__(self) -> None:
        object.__setattr__(self, "help", textwrap.dedent(self.help).strip())
        object.__setattr__(self, "example", textwrap.dedent(self.example).strip())

    @property
    def dynamic(self) -> bool:
        return callable(self.default)

    @property
    def settable(self) -> bool:
        """Written in the file (or a flag), unlike a derived field."""
        return self.kind is not DERIVED


@dataclass(frozen=True)
class Section:
    """A heading of the example file and the docs, and its keys in order."""

    title: str
    keys: tuple[Key, ...]
    help: str = ""  # a paragraph under the heading

    def __post_init__(self) -> None:
        object.__setattr__(self, "help", textwrap.dedent(self.help).strip())

