#!/usr/bin/env python3
"""Build kvprefetchd_<version>_amd64.deb from this tree, offline, with debhelper.

Why debhelper (debian/) rather than nfpm: everything it needs is in Debian (nfpm is not),
the package is built by Debian's own Python and setuptools against Debian's python3-* and
liburing, and the systemd helpers (dh_installsystemd, dh_installsysusers) write the
maintainer scripts Debian expects: enable/start the socket, create the user, handle purge.

The tree's tracked files are copied to a scratch folder (dpkg-buildpackage writes its
results beside the source), debian/changelog is written there from kvprefetchd.__version__
(the one version source), and the .deb lands in --out. Build dependencies: debian/control
(./dev package installs them).
"""

from __future__ import annotations

import email.utils
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from outdir import output_dir

ROOT = Path(__file__).resolve().parent.parent


def version() -> str:
    namespace: dict[str, str] = {}
    exec((ROOT / "daemon/kvprefetchd/__init__.py").read_text(), namespace)
    return namespace["__version__"]


def tracked_files() -> list[str]:
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], capture_output=True, check=True)
    return sorted(n for n in listed.stdout.decode().split("\0")
                  if n and (ROOT / n).exists() and not n.startswith("dist/"))


def changelog(release: str) -> str:
    when = email.utils.formatdate(localtime=False)
    return (f"kvprefetchd ({release}) unstable; urgency=medium\n\n"
            f"  * Release {release}: see the project's README and issues.\n\n"
            f" -- kvprefetchd developers <kvprefetchd@localhost>  {when}\n")


def main() -> int:
    out = output_dir(__doc__.splitlines()[0])
    release = version()
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / f"kvprefetchd-{release}"
        for name in tracked_files():
            target = source / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target, follow_symlinks=False)
        (source / "debian" / "changelog").write_text(changelog(release))
        # Debian's python3 and tools only: a python3 earlier on PATH (a pyenv, a venv)
        # has neither Debian's setuptools (--install-layout=deb) nor its dist-packages.
        clean = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8",
                 "HOME": tmp, "DEB_BUILD_OPTIONS": "nocheck"}
        done = subprocess.run(["dpkg-buildpackage", "-b", "-us", "-uc"], cwd=source, env=clean,
                              capture_output=True, text=True, timeout=1200)
        if done.returncode != 0:
            raise SystemExit(f"dpkg-buildpackage failed ({done.returncode}):\n"
                             f"{done.stdout[-5000:]}\n{done.stderr[-3000:]}")
        (deb,) = Path(tmp).glob(f"kvprefetchd_{release}_*.deb")
        made = shutil.move(str(deb), out / deb.name)
    print(json.dumps({"deb": str(made)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
