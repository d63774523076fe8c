"""`kvprefetchd`: flags -> Config -> Supervisor.run(), in the foreground, logging to stderr."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from kvprefetchd import __version__
from kvprefetchd.config import (
    ENGINES,
    LOG_LEVELS,
    WARM_MODES,
    Config,
    ConfigError,
    build_config,
    load_file,
)
from kvprefetchd.engines import NoEngine
from kvprefetchd.logs import setup_logging
from kvprefetchd.server import SocketInUse
from kvprefetchd.supervisor import HaltError, Supervisor

EXIT_CONFIG = 2
EXIT_HALTED = 1


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvprefetchd",
        description="Warm the heads of KV-cache files on request, over a Unix socket.",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    parser.add_argument("--socket", metavar="PATH", help="Unix socket to listen on")
    parser.add_argument(
        "--root", metavar="DIR", action="append", dest="roots",
        help="allowed root directory (repeatable); replaces the configured roots",
    )
    parser.add_argument(
        "--workers", type=int, metavar="N", help="worker processes (0: one per CPU)"
    )
    parser.add_argument("--engine", choices=ENGINES)
    parser.add_argument("--warm-mode", choices=WARM_MODES, dest="warm_mode")
    parser.add_argument("--read-bytes", type=int, metavar="N", dest="read_bytes")
    parser.add_argument("--log-level", choices=LOG_LEVELS, dest="log_level")
    parser.add_argument("--version", action="version", version=f"kvprefetchd {__version__}")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["install-systemd"]:
        from kvprefetchd import install

        return install.main(argv[1:])
    args = parse_args(argv)
    overrides: dict[str, Any] = {
        key: value
        for key, value in (
            ("socket", args.socket),
            ("roots", args.roots),
            ("workers", args.workers),
            ("engine", args.engine),
            ("warm_mode", args.warm_mode),
            ("read_bytes", args.read_bytes),
            ("log_level", args.log_level),
        )
        if value is not None
    }
    def read_config() -> Config:
        return build_config(load_file(args.config) if args.config else {}, overrides)

    try:
        config = read_config()
    except ConfigError as error:
        print(f"kvprefetchd: configuration error: {error}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(config.log_level)
    log = logging.getLogger("kvprefetchd")
    try:
        return Supervisor(config, reload_from=read_config).run()
    except (HaltError, NoEngine, SocketInUse) as error:
        log.error("%s", error)
        return EXIT_HALTED
    except OSError as error:
        # Which socket failed, when the error knows (server.listen_unix names it).
        where = error.filename if error.filename is not None else config.socket
        log.error("cannot serve on %s: %s", where, error.strerror or error)
        return EXIT_HALTED
