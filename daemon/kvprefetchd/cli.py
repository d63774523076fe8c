"""`kvprefetchd`: flags -> Config -> Supervisor.run(), in the foreground, logging to stderr."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from kvprefetchd import __version__
from kvprefetchd.addresses import SOCKET_CHAIN
from kvprefetchd.config import Config, ConfigError, build_config, load_file
from kvprefetchd.config_keys import DEFAULT_ROOT, KEYS, Key
from kvprefetchd.config_keys.key import CHOICE, INT, LISTS
from kvprefetchd.engines import NoEngine
from kvprefetchd.listeners.listening import SocketInUse
from kvprefetchd.listeners.tls_context import TlsSetupError
from kvprefetchd.logs import setup_logging
from kvprefetchd.supervisor.loop import HaltError, Supervisor

EXIT_CONFIG = 2
EXIT_HALTED = 1

# The keys with a flag (the table's), and those an environment variable sets below the flag.
FLAG_KEYS = tuple(key for key in KEYS if key.flag is not None)
ENV_KEYS = tuple(key for key in KEYS if key.env)


def _env_line(key: Key) -> str:
    flag, metavar = (key.flag.name, key.flag.metavar) if key.flag else (key.name, None)
    return f"  {key.env}={metavar or 'VALUE'}   as {flag} (the flag wins)\n"


USAGE_TAIL = f"""\
commands:
  kvprefetchd [FLAGS]             serve (the default): flags override the config file
  kvprefetchd install-systemd     install the units, the example config and the system user
                                  (see `kvprefetchd install-systemd --help`)

Flags override the config file (--config), which overrides the built-in defaults: run with
no config and no flags, it serves on the default socket and root {DEFAULT_ROOT}. Every
other setting is a config key (docs/configuration.md, systemd/config.example.toml).

{textwrap.fill(f"The default socket: {SOCKET_CHAIN}.", 90)}

environment:
{"".join(_env_line(key) for key in ENV_KEYS)}\
  KVPREFETCHD_SOCKET, RUNTIME_DIRECTORY, XDG_RUNTIME_DIR
                        where the default socket goes (above)
  LISTEN_FDS, LISTEN_PID, NOTIFY_SOCKET, WATCHDOG_USEC, JOURNAL_STREAM
                        set by systemd: socket activation, readiness and watchdog, and
                        journal priority prefixes on log lines
  KVP_NO_LIBURING=1     (at build time) build without the io_uring engine

exit status: 0 stopped cleanly, 1 could not serve (the log says why), 2 bad configuration.
"""


def build_parser() -> argparse.ArgumentParser:
    """The daemon's flags: --config, --version, and one per key with a flag in the table."""
    parser = argparse.ArgumentParser(
        prog="kvprefetchd",
        description="Warm the heads of KV-cache files on request, over a Unix socket.",
        epilog=USAGE_TAIL,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    for key in FLAG_KEYS:
        assert key.flag is not None
        options: dict[str, Any] = {"dest": key.name, "metavar": key.flag.metavar}
        if key.kind is CHOICE:
            options = {"dest": key.name, "choices": key.choices}
        elif key.kind is INT:
            options["type"] = int
        elif key.kind in LISTS:
            options["action"] = "append"
        env = f" (default: ${key.env}, else the config)" if key.env else ""
        parser.add_argument(key.flag.name, help=key.flag.help + env, **options)
    parser.add_argument("--version", action="version", version=f"kvprefetchd {__version__}")
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["install-systemd"]:
        from kvprefetchd import install

        return install.main(argv[1:])
    args = parse_args(argv)
    overrides: dict[str, Any] = {}
    for key in FLAG_KEYS:
        value = getattr(args, key.name)
        if value is None and key.env:
            value = os.environ.get(key.env)
        if value is not None:
            overrides[key.name] = value

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
    except (HaltError, NoEngine, SocketInUse, TlsSetupError) as error:
        log.error("%s", error)
        return EXIT_HALTED
    except OSError as error:
        # Which socket failed, when the error knows (listening.listen_unix names it).
        where = error.filename if error.filename is not None else config.socket
        log.error("cannot serve on %s: %s", where, error.strerror or error)
        return EXIT_HALTED
