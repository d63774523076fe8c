"""The atheris target: its checker replays the frame corpus everywhere, and where atheris
is installed (it is optional, never a dependency) libFuzzer runs it briefly."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fuzz_protocol

HERE = Path(__file__).resolve().parent
CORPUS = sorted((HERE.parent / "corpus" / "frames").glob("*.bin"))
RUNS = 2000  # a smoke run: search for real with -max_total_time (fuzz_protocol.py)


def test_the_target_accepts_every_corpus_frame_in_both_shapes() -> None:
    assert CORPUS
    for path in CORPUS:
        data = path.read_bytes()
        for shape in (0x00, 0x01, 0x40, 0xFF):  # raw streams and bodies, small and big reads
            fuzz_protocol.check(bytes([shape]) + data)


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None,
                    reason="atheris is not installed (optional: pip install atheris)")
def test_libfuzzer_runs_the_target_without_a_finding(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for path in CORPUS:  # libFuzzer adds what it finds to the first directory: a copy
        shutil.copy(path, corpus / path.name)
    done = subprocess.run(
        [sys.executable, str(HERE / "fuzz_protocol.py"), f"-atheris_runs={RUNS}", "-seed=1",
         "-max_total_time=60", "-max_len=4096", f"-artifact_prefix={tmp_path}/", str(corpus)],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path,
    )
    tail = done.stderr[-4000:]
    assert done.returncode == 0, tail
    assert "Done" in tail, tail
