"""`python -m kvprefetchd.config_keys --write | --check | --toml | --markdown | --fields`:
rewrite (or check, or print) the files generated from the table of config keys."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from kvprefetchd.config_keys.render import configuration_markdown, example_toml, fields_module

REPO = Path(__file__).resolve().parents[3]
GENERATED: dict[str, tuple[Path, Callable[[], str]]] = {
    "toml": (REPO / "systemd" / "config.example.toml", example_toml),
    "markdown": (REPO / "docs" / "configuration.md", configuration_markdown),
    "fields": (REPO / "daemon" / "kvprefetchd" / "config_fields.py", fields_module),
}


def stale() -> list[Path]:
    """The generated files whose text is not what the table makes now."""
    return [path for path, render in GENERATED.values()
            if not path.exists() or path.read_text() != render()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvprefetchd.config_keys",
                                     description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", action="store_true", help="rewrite every generated file")
    group.add_argument("--check", action="store_true",
                       help="exit 1, naming them, if generated files are stale")
    for name in GENERATED:
        group.add_argument(f"--{name}", action="store_true", help=f"print the {name} file")
    args = parser.parse_args(argv)
    if args.write:
        for path, render in GENERATED.values():
            text = render()
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
                print(f"wrote {path.relative_to(REPO)}")
        return 0
    if args.check:
        paths = stale()
        for path in paths:
            print(f"stale: {path.relative_to(REPO)} ({GENERATED_BY_HINT})", file=sys.stderr)
        return 1 if paths else 0
    for name, (_, render) in GENERATED.items():
        if getattr(args, name):
            sys.stdout.write(render())
    return 0


GENERATED_BY_HINT = "run python -m kvprefetchd.config_keys --write"

if __name__ == "__main__":
    sys.exit(main())
