"""The queue under ThreadSanitizer: its threads, the threads it starts as a burst grows it
(outside its lock), and a fallback forced from another thread while they read (the
force-fallback flags are atomics: before they were, TSAN reported the flag's store racing
open.c's loads). Built from native/*.c with gcc -fsanitize=thread into tmp_path; a host
whose gcc has no libtsan, or whose kernel TSAN cannot map, skips."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from native_helpers import KiB, write_file

NATIVE = Path(__file__).resolve().parents[2] / "native"
HARNESS = Path(__file__).resolve().parent / "tsan_queue.c"
# The one race by design: every read lands in a shared scratch buffer whose bytes are thrown
# away (queue.c, "the work of one file"); pread's interceptor is the writer's frame.
SUPPRESSIONS = "race:pread\n"


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("no gcc")
    out = tmp_path_factory.mktemp("tsan") / "tsan_queue"
    sources = sorted(str(p) for p in NATIVE.glob("*.c"))
    built = subprocess.run([cc, "-g", "-O1", "-fsanitize=thread", f"-I{NATIVE}", str(HARNESS),
                            *sources, "-o", str(out), "-lpthread", "-lm"],
                           capture_output=True, text=True, check=False)
    if built.returncode != 0:
        pytest.skip(f"cannot build with -fsanitize=thread: {built.stderr.strip()[-300:]}")
    return out


@pytest.mark.parametrize(("engine", "warm_mode"), [("pread", "read"), ("fadvise", "advise")])
def test_the_queue_is_race_free_under_a_forced_fallback(harness: Path, tmp_path: Path,
                                                        engine: str, warm_mode: str) -> None:
    files = tmp_path / "files"
    files.mkdir()
    for i in range(64):
        write_file(files / f"f{i}", 64 * KiB)
    (tmp_path / "supp").write_text(SUPPRESSIONS)
    env = {**os.environ, "TSAN_OPTIONS": f"suppressions={tmp_path / 'supp'} exitcode=66"}
    ran = subprocess.run([str(harness), str(files), "1500", engine, warm_mode],
                         capture_output=True, text=True, env=env, timeout=300, check=False)
    if "FATAL: ThreadSanitizer" in ran.stderr:  # e.g. a memory layout it cannot map
        pytest.skip(f"ThreadSanitizer cannot run here: {ran.stderr.strip()[:300]}")
    assert "WARNING: ThreadSanitizer" not in ran.stderr, ran.stderr[-4000:]
    assert ran.returncode == 0, ran.stderr[-2000:]
    result = json.loads(ran.stdout)
    assert result["read"] == result["settled"] == 1500
    assert 1 <= result["threads"] <= 16 and result["spawn_failures"] == 0
