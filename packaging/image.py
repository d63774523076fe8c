#!/usr/bin/env python3
"""Build kvprefetchd's container image with podman, offline, and check it answers.

No registry is reachable here, so the base image is a Debian 12 root file system made by
debootstrap (the real-systemd test's cached tree, tests/system/system_rootfs.py) imported
into podman. The build context holds the wheels: ours from packaging/build_dists.py and the
dependencies' from the host's `pip download` (for CPython 3.11, manylinux); the Containerfile
installs them with --no-index, so the build needs no network. Then a container of the image
serves a read-only root and `kvprefetch ping` inside it must answer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "system"))


import system_install  # noqa: E402  (the container's wheel download, shared with the test)
import system_rootfs  # noqa: E402

import kvprefetchd  # noqa: E402

BASE = "localhost/kvprefetchd-base:bookworm"
# crun (podman's default) refuses a hybrid cgroup host ("cgroups in hybrid mode not
# supported"), as this machine is; runc runs there, and on pure cgroup2 hosts too.
PODMAN_OPTIONS = ("--runtime", "runc", "--cgroup-manager", "cgroupfs")


def podman(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["podman", *PODMAN_OPTIONS, *argv], capture_output=True, text=True,
                          timeout=1800)
    if check and done.returncode != 0:
        raise SystemExit(f"podman {' '.join(argv)} failed ({done.returncode}):\n"
                         f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done


def ensure_base(work: Path) -> None:
    if subprocess.run(["podman", "image", "exists", BASE]).returncode == 0:
        return
    rootfs = system_rootfs.ensure_rootfs(work / "debootstrap.log").path
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--exclude", "./proc/*",
                            "--exclude", "./sys/*", "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["podman", "import", "-", BASE], stdin=tar.stdout, check=True,
                   capture_output=True, timeout=900)
    assert tar.wait() == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default=None, help="default localhost/kvprefetchd:VERSION")
    args = parser.parse_args()
    version = kvprefetchd.__version__
    tag = args.tag or f"localhost/kvprefetchd:{version}"
    figures: dict[str, object] = {"image": tag}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        started = time.monotonic()
        ensure_base(work)
        figures["base_s"] = round(time.monotonic() - started, 1)
        context = work / "context"
        wheels = context / "wheels"
        wheels.mkdir(parents=True)
        made = json.loads(subprocess.run(
            [sys.executable, str(ROOT / "packaging" / "build_dists.py"), "--out",
             str(work / "dist")], capture_output=True, text=True, check=True).stdout)
        for name in ("daemon_wheel", "client_wheel"):
            shutil.copy(made[name], wheels)
        system_install.download_wheels(wheels, work / "pip-download.log")
        shutil.copy(ROOT / "Containerfile", context / "Containerfile")
        started = time.monotonic()
        podman("build", "--network", "none", "--build-arg", f"BASE={BASE}", "-t", tag,
               "-f", str(context / "Containerfile"), str(context))
        figures["build_s"] = round(time.monotonic() - started, 1)
        # The smoke test: a read-only root mounted at /mnt/kv, the socket inside.
        kv = work / "kv"
        kv.mkdir()
        name = f"kvprefetchd-smoke-{int(time.time())}"
        # Limits at or under this host's: podman's defaults for root (nofile 1048576, nproc
        # past the host's) need CAP_SYS_RESOURCE to raise, which this machine's root lacks.
        podman("run", "-d", "--rm", "--name", name, "--network", "none",
               "--ulimit", "nofile=16384:16384", "--ulimit", "nproc=4096:4096",
               "-v", f"{kv}:/mnt/kv:ro", tag)
        try:
            deadline = time.monotonic() + 60
            while True:
                ping = podman("exec", name, "kvprefetch", "ping", check=False)
                if ping.returncode == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            figures["ping"] = ping.stdout.strip() or ping.stderr.strip()
            if ping.returncode != 0:
                logs = podman("logs", name, check=False)
                raise SystemExit(f"kvprefetch ping failed inside {tag}: {ping.stderr}\n"
                                 f"{logs.stdout}{logs.stderr}")
            user = podman("exec", name, "id", "-u").stdout.strip()
            gcc = podman("exec", name, "sh", "-c", "command -v gcc cc", check=False)
            figures["uid"], figures["compiler"] = int(user), gcc.stdout.strip() or None
        finally:
            podman("rm", "-f", name, check=False)
        size = podman("image", "inspect", tag, "--format", "{{.Size}}").stdout.strip()
        figures["size_mb"] = round(int(size) / 1e6)
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
