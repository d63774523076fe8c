"""The one command-line both packaging scripts take: --out, the folder they write to."""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def output_dir(description: str) -> Path:
    """Parse --out (default dist/ of the tree), make it, and return it absolute."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=ROOT / "dist")
    out: Path = parser.parse_args().out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    return out
