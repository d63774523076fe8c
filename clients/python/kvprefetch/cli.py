"""`kvprefetch`: ask a running kvprefetchd to warm files, or how it is doing.

Exit codes are part of the interface, so scripts can tell a refusal from an absent daemon:
0 ok, 1 the daemon refused or the call failed, 2 usage, 3 cannot connect.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Any

from kvprefetch import __version__
from kvprefetch.client import Client
from kvprefetch.errors import ConnectFailed, KVPrefetchError, ServerError
from kvprefetch.protocol import DEFAULT_SOCKET, Outcome, Path, wire_path
from kvprefetch.results import PrefetchResult, merge_prefetch
from kvprefetch.stats import Stats

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_DAEMON = 3

SOCKET_ENV = "KVPREFETCHD_SOCKET"
# Requests are split well below the daemon's 16 MiB frame limit so `find | kvprefetch warm -`
# works for any number of files, and the daemon can start on early batches sooner.
BATCH_PATHS = 4096
BATCH_BYTES = 1024 * 1024


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits for --help and usage errors; main returns
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    client = Client(args.socket, timeout=args.timeout or None)
    args.socket = client.socket_path
    try:
        with client:
            output = args.run(client, args)
    except ConnectFailed as exc:
        return _fail(str(exc), EXIT_NO_DAEMON)
    except ServerError as exc:
        return _fail(f"kvprefetchd refused the request: {exc}", EXIT_FAILED)
    except KVPrefetchError as exc:
        return _fail(str(exc), EXIT_FAILED)
    except ValueError as exc:
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
        type=float,
        default=30.0,
        help="seconds to wait for the daemon, on top of --timeout-ms; 0 waits forever",
    )
    output = argparse.ArgumentParser(add_help=False)
    output.add_argument("--json", action="store_true", help="print one JSON object")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ping = commands.add_parser("ping", parents=[output], help="check the daemon answers")
    ping.set_defaults(run=_run_ping, describe=_describe_ping)

    warm = commands.add_parser("warm", parents=[output], help="warm the heads of files")
    warm.add_argument("paths", nargs="+", metavar="PATH", help="files to warm; - reads stdin")
    warm.add_argument("--wait", action="store_true", help="wait for every file's outcome")
    warm.add_argument("--read-bytes", type=_count, metavar="N", help="bytes to read per file")
    warm.add_argument(
        "--timeout-ms", type=_count, metavar="N", help="with --wait: stop waiting after N ms"
    )
    warm.set_defaults(run=_run_warm, describe=_describe_warm)

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
    warm_request.add_argument("--read-bytes", type=_count, metavar="N")
    warm_request.add_argument("--timeout-ms", type=_count, metavar="N")
    warm_request.set_defaults(run=_run_warm_request, describe=_describe_warm_request)

    stats = commands.add_parser("stats", parents=[output], help="show the daemon's counters")
    stats.set_defaults(run=_run_stats, describe=_describe_stats)
    return parser


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {value}")
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


def _run_warm(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    if args.timeout_ms is not None and not args.wait:
        raise ValueError("--timeout-ms needs --wait")
    batches = list(_batches(_expand_paths(args.paths)))
    if not batches:
        return asdict(PrefetchResult(0, 0, 0))
    results = client.prefetch_many(
        batches, wait=args.wait, read_bytes=args.read_bytes, timeout_ms=args.timeout_ms
    )
    return asdict(merge_prefetch(results))


def _describe_warm(out: dict[str, Any], args: argparse.Namespace) -> str:
    line = f"accepted {out['accepted']}, dropped {out['dropped']}, rejected {out['rejected']}"
    outcomes: dict[str, int] | None = out["outcomes"]
    if outcomes is not None:
        known = [o.value for o in Outcome if o.value in outcomes]
        names = known + sorted(set(outcomes) - set(known))
        line += "; " + ", ".join(f"{name} {outcomes[name]}" for name in names)
    if out["elapsed_us"] is not None:
        line += f" in {out['elapsed_us'] / 1000:.1f} ms"
    return line


def _run_stats(client: Client, args: argparse.Namespace) -> Stats:
    return client.stats()


def _describe_stats(out: Stats, args: argparse.Namespace) -> str:
    return "\n".join(f"{key} {value}" for key, value in _flatten(out))


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


def _expand_paths(args: Sequence[str]) -> Iterator[Path]:
    """Paths as the daemon needs them: absolute (it has its own cwd) and, where the name is
    not UTF-8, as bytes. `-` stands for stdin, one path a line."""
    for arg in args:
        if arg == "-":
            for line in _stdin_bytes().split(b"\n"):
                if line:
                    yield os.path.abspath(_text_if_utf8(line))
        else:
            yield os.path.abspath(wire_path(arg))


def _stdin_bytes() -> bytes:
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is not None:
        data: bytes = buffer.read()
        return data
    return os.fsencode(sys.stdin.read())


def _text_if_utf8(raw: bytes) -> Path:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def _batches(paths: Iterator[Path]) -> Iterator[list[Path]]:
    batch: list[Path] = []
    size = 0
    for path in paths:
        length = len(path.encode() if isinstance(path, str) else path)
        if batch and (len(batch) == BATCH_PATHS or size + length > BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(path)
        size += length
    if batch:
        yield batch


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _flatten(value[key], f"{prefix}.{_text(key)}" if prefix else _text(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _flatten(item, f"{prefix}[{index}]")
    else:
        yield prefix, _text(value) if isinstance(value, bytes) else value


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
