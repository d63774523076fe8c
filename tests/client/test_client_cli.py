"""The `kvprefetch` command: main(argv) in-process, plus `python -m kvprefetch` for real."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fake_daemon import FakeDaemon

import kvprefetch
from kvprefetch import cli
from kvprefetch.bulk import (
    BATCH_PATHS,
    MAX_EMPTY_RUN,
    MAX_LINE_BYTES,
    READ_CHUNK,
    ListError,
    read_paths,
)

CLIENT_SRC = Path(kvprefetch.__file__).resolve().parents[1]  # so the child imports this tree


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ping_human_and_json(daemon: FakeDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--socket", daemon.path, "ping")
    assert code == 0
    assert out == f"kvprefetchd 0.0-fake at {daemon.path}: protocol 1, engine pread, 2 workers\n"
    code, out, _ = run_cli(capsys, "--socket", daemon.path, "ping", "--json")
    assert code == 0
    assert json.loads(out) == {
        "version": "0.0-fake",
        "protocol": 1,
        "engine": "pread",
        "workers": 2,
    }


def test_warm_human_and_json(daemon: FakeDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--socket", daemon.path, "warm", "/a", "/b")
    assert code == 0
    assert re.fullmatch(r"2 files: accepted 2; rejected 0, dropped 0 in \d+\.\d\d s\n", out)
    code, out, _ = run_cli(
        capsys, "--socket", daemon.path, "warm", "/a", "/b/missing", "--wait", "--json"
    )
    assert code == cli.EXIT_SOME_FILES  # a file is missing
    reply = json.loads(out)
    reply.pop("elapsed_s")
    assert reply == {
        "files": 2, "accepted": 2, "dropped": 0, "rejected": 0, "resent": 0,
        "outcomes": {"read": 1, "missing": 1}, "failures": [], "failures_unlisted": 0,
    }
    code, out, _ = run_cli(capsys, "--socket", daemon.path, "--json", "warm", "/a", "/b/missing",
                           "--wait", "--ignore-missing")
    assert code == 0 and json.loads(out)["outcomes"] == {"read": 1, "missing": 1}
    code, out, _ = run_cli(capsys, "--socket", daemon.path, "warm", "/a", "/b/missing", "--wait")
    assert out.startswith("2 files: accepted 2; read 1, missing 1; rejected 0, dropped 0 in ")


def test_warm_options_reach_the_wire(
    daemon: FakeDaemon, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--socket", daemon.path, "warm", "/a", "--wait", "--read-bytes", "8192"]
    assert run_cli(capsys, *argv, "--timeout-ms", "250")[0] == 0
    (request,) = daemon.requests("prefetch")
    assert (request["wait"], request["read_bytes"], request["timeout_ms"]) == (True, 8192, 250)


def test_warm_makes_relative_paths_absolute(
    daemon: FakeDaemon,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert run_cli(capsys, "--socket", daemon.path, "warm", "shard.bin")[0] == 0
    assert daemon.requests("prefetch")[0]["paths"] == [str(tmp_path / "shard.bin")]


def test_warm_reads_stdin_one_path_a_line(
    daemon: FakeDaemon, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    stdin = io.TextIOWrapper(io.BytesIO(b"/kv/a.bin\n\n/kv/\xff.bin\n"))
    monkeypatch.setattr(sys, "stdin", stdin)
    code, out, _ = run_cli(capsys, "--socket", daemon.path, "warm", "/first", "-")
    assert code == 0 and out.startswith("3 files: accepted 3;")
    paths = daemon.requests("prefetch")[0]["paths"]
    assert paths == ["/first", "/kv/a.bin", b"/kv/\xff.bin"]  # the non-UTF-8 name as bin


def test_warm_splits_long_lists_into_pipelined_batches(
    daemon: FakeDaemon, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = "".join(f"/kv/{i:06}.bin\n" for i in range(10_000)).encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines)))
    code, out, _ = run_cli(capsys, "--socket", daemon.path, "warm", "-", "--json")
    assert code == 0
    assert json.loads(out)["accepted"] == 10_000
    sizes = sorted(len(r["paths"]) for r in daemon.requests("prefetch"))
    full, rest = divmod(10_000, BATCH_PATHS)
    assert sizes == [rest] + [BATCH_PATHS] * full
    assert daemon.connections == 2  # the batches pipelined on one, the Watchdog's probes


def test_stats_human_and_json(daemon: FakeDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--socket", daemon.path, "stats", "--json")
    assert code == 0
    stats = json.loads(out)
    assert stats["files"] == {"read": 3, "missing": 1}
    assert stats["workers"] == {"0": {"queue": 0}, "1": {"queue": 2}}
    code, out, _ = run_cli(capsys, "--socket", daemon.path, "stats")
    assert code == 0  # not this version's map: every figure, one a line
    assert "files.read 3\n" in out
    assert "workers.1.queue 2\n" in out



def test_socket_comes_from_the_environment(
    daemon: FakeDaemon, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cli.SOCKET_ENV, daemon.path)
    assert run_cli(capsys, "ping")[0] == 0


def test_missing_socket_exits_3_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "nobody.sock")
    code, out, err = run_cli(capsys, "--socket", path, "ping")
    assert (code, out) == (cli.EXIT_NO_DAEMON, "")
    assert path in err
    assert "cannot connect" in err


def test_server_error_exits_1(daemon: FakeDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    daemon.fail_with["prefetch"] = ("overloaded", "queue full")
    code, out, err = run_cli(capsys, "--socket", daemon.path, "warm", "/a")
    assert (code, out) == (cli.EXIT_FAILED, "")
    assert "overloaded: queue full" in err


def test_timeout_exits_1(daemon: FakeDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    daemon.delay_s["ping"] = 0.5
    code, _, err = run_cli(capsys, "--socket", daemon.path, "--timeout", "0.1", "ping")
    assert code == cli.EXIT_FAILED
    assert "in time" in err


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["warm"],
        ["frobnicate"],
        ["warm", "/a", "--timeout-ms", "10"],  # without --wait
        ["warm", "/a", "--read-bytes", "-1"],
        ["warm", "/a", "--read-bytes", "lots"],
    ],
)
def test_usage_errors_exit_2(
    daemon: FakeDaemon, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = run_cli(capsys, "--socket", daemon.path, *argv)
    assert (code, out) == (cli.EXIT_USAGE, "")
    assert err
    assert daemon.requests("prefetch") == []


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    assert "3 cannot connect" in out


def _python_m(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(CLIENT_SRC), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "kvprefetch", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_python_m_kvprefetch(daemon: FakeDaemon, tmp_path: Path) -> None:
    done = _python_m("--socket", daemon.path, "ping", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["protocol"] == 1
    done = _python_m("--socket", str(tmp_path / "nobody.sock"), "ping")
    assert done.returncode == 3
    assert "nobody.sock" in done.stderr


# --- lists: a line is at most PATH_MAX, read in bounded memory (issue 23, finding 9) ----------


class Endless(io.RawIOBase):
    """A list that never ends and has no separator (`-f /dev/zero`), counting its reads."""

    def __init__(self, byte: bytes = b"x") -> None:
        self.byte = byte
        self.reads = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        self.reads += 1
        return self.byte * (size if size > 0 else READ_CHUNK)


def test_a_line_of_path_max_is_read_and_one_byte_more_stops_the_list() -> None:
    most = b"/" + b"a" * (MAX_LINE_BYTES - 1)
    listing = io.BytesIO(b"/kv/x\n" + most + b"\n" + most + b"b\n/kv/y\n")
    paths = read_paths(["-"], [], nul=False, stdin=listing)
    assert next(paths) == "/kv/x" and next(paths) == most.decode()
    with pytest.raises(ListError, match=r"^stdin: line 3 is longer than 4096 bytes"):
        next(paths)


def test_an_endless_line_is_refused_after_one_chunk_not_kept() -> None:
    endless = Endless()
    with pytest.raises(ListError, match="line 1 is longer"):
        list(read_paths(["-"], [], nul=False, stdin=endless))  # type: ignore[arg-type]
    assert endless.reads == 1


def test_nul_separated_records_are_counted_and_capped_alike(tmp_path: Path) -> None:
    listing = tmp_path / "list0"
    listing.write_bytes(b"/kv/a\0\0/kv/b\0/" + b"c" * 5000 + b"\0")
    paths = read_paths([], [str(listing)], nul=True)
    assert [next(paths), next(paths)] == ["/kv/a", "/kv/b"]
    with pytest.raises(ListError, match=rf"^{listing}: record 4 is longer"):
        next(paths)


def test_a_long_path_operand_is_refused_too() -> None:
    with pytest.raises(ListError, match="PATH operand 2"):
        list(read_paths(["/kv/a", "/" + "x" * MAX_LINE_BYTES], [], nul=False))


def test_a_long_line_exits_2_before_anything_is_sent(
    daemon: FakeDaemon, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = b"/kv/a.bin\n/" + b"x" * (17 << 20) + b"\n/kv/b.bin\n"  # 0.3.0: dropped, exit 0
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines)))
    code, out, err = run_cli(capsys, "--socket", daemon.path, "warm", "-")
    assert (code, out) == (cli.EXIT_USAGE, "")
    assert "stdin: line 2 is longer than 4096 bytes (PATH_MAX)" in err
    assert daemon.requests("prefetch") == []


def test_a_batch_refused_early_in_a_long_list_fails_the_run(
    daemon: FakeDaemon, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """0.3.0 forgot a batch's error once its task had finished, and exited 0."""
    lines = b"/refuse\n" + b"".join(b"/kv/%06d.bin\n" % i for i in range(30 * BATCH_PATHS))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines)))
    code, _, err = run_cli(capsys, "--socket", daemon.path, "warm", "-")
    assert code == cli.EXIT_FAILED and "refused on request" in err, err


def test_endless_empty_records_are_no_list() -> None:
    """`-0 -f /dev/zero`: only empty records, for ever; refused after MAX_EMPTY_RUN."""
    endless = Endless(b"\0")
    with pytest.raises(ListError, match=rf"records 1 to {MAX_EMPTY_RUN + 1} are empty"):
        list(read_paths(["-"], [], nul=True, stdin=endless))  # type: ignore[arg-type]
    assert endless.reads <= 2


def test_blank_lines_crlf_ones_too_are_skipped_not_sent_as_the_cwd() -> None:
    listing = io.BytesIO(b"/kv/a\r\n\r\n\n/kv/b\r\n")
    assert list(read_paths(["-"], [], nul=False, stdin=listing)) == ["/kv/a", "/kv/b"]
