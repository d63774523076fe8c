"""`kvprefetch`: ask a running kvprefetchd to warm files, or how it is doing.

Exit codes are part of the interface, so scripts can tell a refusal from an absent daemon:
0 ok (warm: every file warmed or resident), 1 the daemon refused or the call failed,
2 usage, 3 cannot connect, 4 some files were not warmed (missing, rejected, failed,
expired or dropped: listed with -v; --ignore-missing lets missing files pass).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Any

from kvprefetch import __version__, doctor
from kvprefetch.aio import AsyncClient
from kvprefetch.bulk import Bulk, Tally, read_paths
from kvprefetch.client import Client
from kvprefetch.errors import (
    ConnectFailed,
    ConnectionClosed,
    KVPrefetchError,
    ServerError,
    Timeout,
)
from kvprefetch.liveness import DaemonLost, DaemonSilent, Watchdog
from kvprefetch.progress import LINES_EVERY_S, Progress
from kvprefetch.protocol import DEFAULT_SOCKET, Outcome
from kvprefetch.results import Failure, FileState
from kvprefetch.stats import Stats
from kvprefetch.statsview import size_text, summarize_stats

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_DAEMON = 3
EXIT_SOME_FILES = 4

SOCKET_ENV = "KVPREFETCHD_SOCKET"
# The daemon refuses a timeout_ms or deadline_ms above a day (docs/protocol.md, "Numeric
# fields"): said here as a usage error, before anything is sent.
MAX_MILLISECONDS = 86_400_000


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits for --help and usage errors; main returns
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    client = Client(args.socket, timeout=args.timeout or None)
    args.socket = client.socket_path
    try:
        if getattr(args, "doctor", None):  # prints its own report; its exit code says
            with client:                   # whether every root can be warmed usefully
                return int(args.doctor(client, args))
        if getattr(args, "bulk", False):
            return _run_bulk(args)
        with client:
            output = args.run(client, args)
    except ConnectFailed as exc:
        return _fail(str(exc), EXIT_NO_DAEMON)
    except ServerError as exc:
        return _fail(f"kvprefetchd refused the request: {exc}", EXIT_FAILED)
    except KVPrefetchError as exc:
        return _fail(str(exc), EXIT_FAILED)
    except (ValueError, OSError) as exc:
        return _fail(str(exc), EXIT_USAGE)
    if args.json:
        print(json.dumps(_jsonable(output), sort_keys=True))
    else:
        print(args.describe(output, args))
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvprefetch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keep the exit-code lines
    )
    parser.add_argument("--version", action="version", version=f"kvprefetch {__version__}")
    parser.add_argument(
        "--socket",
        default=None,
        help=f"daemon socket (default: ${SOCKET_ENV}, else {DEFAULT_SOCKET} if present, "
        "else the daemon's own default: $RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR or /tmp)",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=30.0,
        help="seconds without any answer from the daemon before giving up (exit 1); 0: "
        "never. warm, check and evict ask it `stats` meanwhile on a connection of their "
        "own, so slow files never time out, only a daemon that stops answering does "
        "(warm-request --wait: on top of its --timeout-ms)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    # Also accepted after the command; SUPPRESS keeps a global --json from being reset there.
    output = argparse.ArgumentParser(add_help=False)
    output.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print one JSON object")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ping = commands.add_parser("ping", parents=[output], help="check the daemon answers")
    ping.set_defaults(run=_run_ping, describe=_describe_ping)

    files = argparse.ArgumentParser(add_help=False)
    files.add_argument("paths", nargs="*", metavar="PATH", help="files; - reads a list on stdin")
    files.add_argument("-f", "--from-file", action="append", default=[], metavar="LIST",
                       dest="lists", help="read paths from LIST, one a line (- for stdin)")
    files.add_argument("-0", "--null", action="store_true",
                       help="lists are NUL-separated (find -print0)")
    files.add_argument("-v", "--verbose", action="store_true",
                       help="list every file not warmed and why (check: every file)")
    files.add_argument("--read-bytes", type=_positive, metavar="N",
                       help="bytes per file (default: the daemon's read_bytes)")
    files.add_argument("--progress", type=_seconds, default=LINES_EVERY_S, metavar="S",
                       help="when stderr is no terminal, a progress line there every S "
                            f"seconds of a run that lasts that long (default {LINES_EVERY_S:g};"
                            " 0: none); a terminal's line is redrawn as the files settle")

    warm = commands.add_parser(
        "warm", parents=[output, files], help="warm the heads of files",
        description="Warm the heads of files, streaming the list in batches paced to the "
                    "daemon's queues; files dropped by a full queue are sent again.")
    warm.add_argument("--wait", action="store_true", help="wait for every file's outcome")
    warm.add_argument(
        "--timeout-ms", type=_milliseconds, metavar="N",
        help="with --wait: the daemon stops waiting for a batch (up to 1,024 files) N ms "
             "after it arrives; files not settled by then count as expired"
    )
    warm.add_argument("--deadline-ms", type=_milliseconds, metavar="N",
                      help="files not started within N ms of reaching the daemon are skipped "
                           "(expired); 0: none, not even the daemon's default")
    warm.add_argument("--ignore-missing", action="store_true",
                      help="missing files do not make the exit code 4")
    warm.set_defaults(bulk=True, op="warm")

    inspecting = argparse.ArgumentParser(add_help=False)  # check and evict
    inspecting.add_argument("--timeout-ms", type=_milliseconds, metavar="N",
                            help="give up on a batch after N ms")

    check = commands.add_parser(
        "check", parents=[output, files, inspecting],
        help="report which files are resident, reading nothing (like vmtouch)",
        description="Residency of files by their root's rule (page cache, or the tier's "
                    "st_blocks), without reading them or changing their atime.")
    check.set_defaults(bulk=True, op="check")

    evict = commands.add_parser(
        "evict", parents=[output, files, inspecting],
        help="drop file heads (or whole files) from the page cache; the daemon must allow it",
        description="POSIX_FADV_DONTNEED over the heads (--whole: the whole files); refused "
                    "unless the daemon runs with allow_evict = true.")
    evict.add_argument("--whole", action="store_true", help="evict whole files, not heads")
    evict.set_defaults(bulk=True, op="evict")

    kv_request = argparse.ArgumentParser(add_help=False)
    source = kv_request.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="NAME", help="a model profile configured in the daemon")
    source.add_argument(
        "--profile", metavar="FILE",
        help="an inline profile: a JSON or TOML file with `hash` and `layout` maps",
    )
    prompts = kv_request.add_mutually_exclusive_group(required=True)
    prompts.add_argument(
        "--tokens", metavar="FILE",
        help="token ids (- for stdin): a JSON array for one prompt, an array of arrays for "
        "several, or whitespace-separated integers",
    )
    prompts.add_argument(
        "--block-hashes", metavar="FILE",
        help="block hashes the caller computed (- for stdin): hex strings, one per line; a "
        "blank line separates prompts",
    )
    kv_request.add_argument("--cache-salt", metavar="SALT", help="vLLM cache_salt of the prompts")

    resolve = commands.add_parser(
        "resolve", parents=[output, kv_request],
        help="print the block hashes and file paths a KV request maps to (no I/O)",
    )
    resolve.set_defaults(run=_run_resolve, describe=_describe_resolve)

    warm_request = commands.add_parser(
        "warm-request", parents=[output, kv_request],
        help="warm the files of a KV request (prefetch_blocks)",
    )
    warm_request.add_argument("--wait", action="store_true", help="wait for every outcome")
    warm_request.add_argument("--read-bytes", type=_positive, metavar="N")
    warm_request.add_argument("--timeout-ms", type=_milliseconds, metavar="N")
    warm_request.set_defaults(run=_run_warm_request, describe=_describe_warm_request)

    stats = commands.add_parser(
        "stats", parents=[output],
        help="a one-screen summary of the daemon's figures (--json: all of them)")
    stats.set_defaults(run=_run_stats, describe=_describe_stats)
    doctor.add_parser(commands, parents=[output])
    return parser


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {value}")
    return value


def _positive(text: str) -> int:
    value = _count(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value <= MAX_MILLISECONDS / 1000:  # also refuses nan
        raise argparse.ArgumentTypeError(f"seconds from 0 to {MAX_MILLISECONDS // 1000}: "
                                         f"{text}")
    return value


def _milliseconds(text: str) -> int:
    value = _count(text)
    if value > MAX_MILLISECONDS:
        raise argparse.ArgumentTypeError(f"at most {MAX_MILLISECONDS} (24 h): {value}")
    return value


def _fail(message: str, code: int) -> int:
    print(f"kvprefetch: {message}", file=sys.stderr)
    return code


# --- commands -----------------------------------------------------------------------------


def _run_ping(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    return asdict(client.ping())


def _describe_ping(out: dict[str, Any], args: argparse.Namespace) -> str:
    return (
        f"kvprefetchd {out['version']} at {args.socket}: protocol {out['protocol']}, "
        f"engine {out['engine']}, {out['workers']} workers"
    )


def _run_bulk(args: argparse.Namespace) -> int:
    """warm, check and evict: the list streamed through the daemon (kvprefetch.bulk)."""
    if not args.paths and not args.lists:
        args.paths = ["-"]  # like cat: no operand, read stdin
    if args.op == "warm" and args.timeout_ms is not None and not args.wait:
        raise ValueError("--timeout-ms needs --wait")
    options: dict[str, Any] = {}
    if args.read_bytes is not None:
        options["read_bytes"] = args.read_bytes
    if args.timeout_ms is not None:
        options["timeout_ms"] = args.timeout_ms
    if args.op == "warm" and args.deadline_ms is not None:
        options["deadline"] = args.deadline_ms / 1000
    if args.op == "evict" and args.whole:
        options["whole"] = True
    verbose = args.verbose and not args.json
    report = _print_failure if verbose else None
    progress = None
    if sys.stderr.isatty():
        progress = Progress(sys.stderr, redraw=True)
    elif args.progress:
        progress = Progress(sys.stderr, redraw=False, every_s=args.progress)
    paths = read_paths(args.paths, args.lists, nul=args.null)
    timeout = args.timeout or None
    runs: list[Bulk] = []

    async def go() -> Tally:
        # The bulk connection has no clock of its own: a batch's reply takes what its
        # files take. The Watchdog, on a connection of its own, gives up on silence.
        async with AsyncClient(args.socket, timeout=None) as client:
            try:
                await asyncio.wait_for(client.connect(), timeout)
            except TimeoutError:
                raise ConnectFailed(client.socket_path, OSError("connect timed out")) from None
            bulk = Bulk(client, args.op, options, wait=args.op != "warm" or args.wait,
                        report=report, progress=progress)
            runs.append(bulk)
            if verbose and args.op != "warm":
                bulk.on_file = _print_file_state
            async with AsyncClient(args.socket, timeout=timeout) as prober:
                # stats, not ping: its counters move the progress line, and say how far
                # the daemon got if it stops answering.
                watchdog = Watchdog(prober, timeout, observe=bulk.observe)
                bulk.on_answer = watchdog.answered
                return await watchdog.guard(bulk.run(paths))

    try:
        tally = asyncio.run(go())
    except (ConnectionClosed, Timeout) as error:
        if not runs:
            raise
        why = "" if isinstance(error, (DaemonLost, DaemonSilent)) else " (it died or restarted)"
        raise KVPrefetchError(f"{error}{why}; gave up with {_standing(runs[0])}") from error
    problems = _problems(tally, args)
    if args.json:
        print(json.dumps(_jsonable(_tally_json(tally, args)), sort_keys=True))
    else:
        print(_describe_tally(tally, args))
    return EXIT_SOME_FILES if problems else EXIT_OK


def _standing(bulk: Bulk) -> str:
    """How far a run got, for the message of one that could not finish."""
    figures = bulk.figures()
    listed = f"{figures.listed:,}" + ("" if figures.listed_all else "+")
    return (f"{'about ' if figures.about else ''}{figures.done:,} of {listed} files "
            f"{figures.verb}, {figures.in_flight:,} still in flight")


def _problems(tally: Tally, args: argparse.Namespace) -> int:
    """Files that make the exit code 4, from the counts (which a daemon that lists no
    failures sends too): not warmed (warm), not looked at (check, evict)."""
    bad = ["rejected", "failed", "expired", "futile"]
    if args.op == "warm" and not args.ignore_missing:
        bad.append("missing")  # check reports missing files; it does not fail on them
    counts = tally.outcomes if args.op == "warm" else tally.states
    supervisor = tally.rejected if args.op == "warm" else 0  # check: among its states
    return sum(counts.get(name, 0) for name in bad) + supervisor + tally.dropped


def _print_failure(failure: Failure) -> None:
    print(f"{failure.outcome}\t{failure.reason}\t{_text(failure.path)}")


def _print_file_state(state: FileState) -> None:
    percent = 100.0 * state.resident_bytes / state.size if state.size else 100.0
    print(f"{state.state}\t{size_text(state.resident_bytes)}/{size_text(state.size)}\t"
          f"{percent:5.1f}%\t{_text(state.path)}")


def _tally_json(tally: Tally, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "files": tally.paths, "rejected": tally.rejected, "dropped": tally.dropped,
        "resent": tally.retried, "elapsed_s": round(time.monotonic() - tally.started, 3),
        "failures": [asdict(f) for f in tally.failures],
        "failures_unlisted": tally.unlisted,
    }
    if args.op == "warm":
        out["accepted"] = tally.accepted
        if args.wait:
            out["outcomes"] = dict(tally.outcomes)
    else:
        out.update(states=dict(tally.states), size_bytes=tally.size_bytes,
                   resident_bytes=tally.resident_bytes)
        if args.op == "evict":
            out["evicted_files"] = tally.evicted_files
    return out


def _describe_tally(tally: Tally, args: argparse.Namespace) -> str:
    elapsed = time.monotonic() - tally.started
    if args.op == "warm":
        line = f"{tally.paths:,} files: accepted {tally.accepted:,}"
        if args.wait:
            named = [o.value for o in Outcome if o.value in tally.outcomes]
            line += "; " + ", ".join(f"{name} {tally.outcomes[name]:,}" for name in named
                                     if tally.outcomes[name])
        line += f"; rejected {tally.rejected:,}, dropped {tally.dropped:,}"
        if tally.retried:
            line += f" ({tally.retried:,} resent after a full queue)"
        return line + f" in {elapsed:.2f} s"
    states = tally.states
    files = sum(states.values())
    resident = states.get("resident", 0)
    lines = [
        ", ".join([f"files: {files:,}", f"resident {resident:,} ({_percent(resident, files)})"]
                  + [f"{name} {states[name]:,}" for name in
                     ("cold", "missing", "rejected", "failed", "expired", "futile")
                     if states.get(name)]),
        f"resident bytes: {size_text(tally.resident_bytes)} of {size_text(tally.size_bytes)} "
        f"({_percent(tally.resident_bytes, tally.size_bytes)}) in {elapsed:.2f} s",
    ]
    if args.op == "evict":
        lines.insert(0, f"evicted: {tally.evicted_files:,} files")
    return "\n".join(lines)


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _describe_warm(out: dict[str, Any], args: argparse.Namespace) -> str:
    line = f"accepted {out['accepted']}, dropped {out['dropped']}, rejected {out['rejected']}"
    outcomes: dict[str, int] | None = out["outcomes"]
    if outcomes is not None:
        known = [o.value for o in Outcome if o.value in outcomes]
        names = known + sorted(set(outcomes) - set(known))
        line += "; " + ", ".join(f"{name} {outcomes[name]}" for name in names)
    if out["elapsed_us"] is not None:
        line += f" in {out['elapsed_us'] / 1000:.1f} ms"
    for failure in out["failures"]:
        line += f"\n{failure['outcome']}\t{failure['reason']}\t{_text(failure['path'])}"
    return line


def _run_stats(client: Client, args: argparse.Namespace) -> Stats:
    return client.stats()


def _describe_stats(out: Stats, args: argparse.Namespace) -> str:
    try:
        return summarize_stats(out)
    except (KeyError, TypeError, ValueError):
        # A daemon of another version, whose map this summary does not know: every
        # figure, one a line, rather than nothing.
        return "\n".join(f"{key} {value}" for key, value in _flatten(out))


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _flatten(value[key], f"{prefix}.{_text(key)}" if prefix else _text(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _flatten(item, f"{prefix}[{index}]")
    else:
        yield prefix, _text(value) if isinstance(value, bytes) else value


def _run_resolve(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    return asdict(client.resolve(**_kv_request(args)))


def _describe_resolve(out: dict[str, Any], args: argparse.Namespace) -> str:
    lines = []
    for index, chain in enumerate(out["block_hashes"]):
        lines.append(f"# prompt {index}: {len(chain)} block hashes")
        lines.extend(chain)
    lines.append(f"# {len(out['paths'])} files")
    lines.extend(_text(path) for path in out["paths"])
    return "\n".join(lines)


def _run_warm_request(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    if args.timeout_ms is not None and not args.wait:
        raise ValueError("--timeout-ms needs --wait")
    result = client.prefetch_blocks(
        wait=args.wait, read_bytes=args.read_bytes, timeout_ms=args.timeout_ms,
        **_kv_request(args),
    )
    return asdict(result)


def _describe_warm_request(out: dict[str, Any], args: argparse.Namespace) -> str:
    return f"{out['files']} files: " + _describe_warm(out, args)


def _kv_request(args: argparse.Namespace) -> dict[str, Any]:
    """The KV request fields of protocol.md from the command line's files."""
    request: dict[str, Any] = {}
    if args.model:
        request["model"] = args.model
    else:
        profile = _load_structured(args.profile)
        if not isinstance(profile, dict) or not {"hash", "layout"} <= set(profile):
            raise ValueError(f"{args.profile}: a profile needs `hash` and `layout` maps")
        request["hash"], request["layout"] = profile["hash"], profile["layout"]
    if args.tokens is not None:
        prompts = _parse_tokens(_read_text(args.tokens), args.tokens)
        request["prompts"] = [
            {"token_ids": tokens, **({"cache_salt": args.cache_salt} if args.cache_salt else {})}
            for tokens in prompts
        ]
    else:
        request["block_hashes"] = _parse_block_hashes(_read_text(args.block_hashes))
    return request


def _read_text(name: str) -> str:
    if name == "-":
        return _stdin_bytes().decode()
    with open(name, encoding="utf-8") as handle:
        return handle.read()


def _load_structured(name: str) -> Any:
    text = _read_text(name)
    if name.endswith(".toml"):
        import tomllib

        return tomllib.loads(text)
    return json.loads(text)


def _parse_tokens(text: str, name: str) -> list[list[int]]:
    stripped = text.strip()
    try:
        value = json.loads(stripped) if stripped.startswith("[") else [
            [int(word) for word in stripped.split()]
        ]
    except ValueError as error:
        raise ValueError(f"{name}: not token ids: {error}") from None
    if value and all(isinstance(t, int) for t in value):
        value = [value]
    if not isinstance(value, list) or not all(
        isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        for p in value
    ):
        raise ValueError(f"{name}: expected an array of token ids or an array of such arrays")
    return value


def _parse_block_hashes(text: str) -> list[list[bytes]]:
    prompts: list[list[bytes]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        if not line:
            if prompts[-1]:
                prompts.append([])
            continue
        try:
            prompts[-1].append(bytes.fromhex(line))
        except ValueError:
            raise ValueError(f"not a hex block hash: {line!r}") from None
    return [p for p in prompts if p]


# --- helpers ------------------------------------------------------------------------------


def _stdin_bytes() -> bytes:
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is not None:
        data: bytes = buffer.read()
        return data
    return os.fsencode(sys.stdin.read())


def _text(value: Any) -> str:
    return os.fsdecode(value) if isinstance(value, bytes) else str(value)


def _jsonable(value: Any) -> Any:
    """bytes (non-UTF-8 paths sent as bin) have no JSON form: use their fsdecode'd text.
    Keys all become text, so mixed key types cannot break sort_keys."""
    if isinstance(value, dict):
        return {_text(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return _text(value)
    return value


if __name__ == "__main__":
    sys.exit(main())
