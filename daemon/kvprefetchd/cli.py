"""`kvprefetchd`: flags -> Config -> Supervisor.run(), in the foreground, logging to stderr."""

from __future__ import annotations

import argparse
import logging
import os
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
from kvprefetchd.listeners.listening import SocketInUse
from kvprefetchd.listeners.tcp import TlsSetupError
from kvprefetchd.logs import setup_logging
from kvprefetchd.supervisor.loop import HaltError, Supervisor

EXIT_CONFIG = 2
EXIT_HALTED = 1


METRICS_ENV = "KVPREFETCHD_METRICS"

USAGE_TAIL = f"""\
commands:
  kvprefetchd [FLAGS]             serve (the default): flags override the config file
  kvprefetchd install-systemd     install the units, the example config and the system user
                                  (see `kvprefetchd install-systemd --help`)

Flags override the config file (--config), which overrides the built-in defaults: run with
no config and no flags, it serves on $RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR or /tmp, root
/tmp/shared-kv. Every other setting is a config key (systemd/config.example.toml).

environment:
  {METRICS_ENV}=ADDR   as --metrics (the flag wins)
  RUNTIME_DIRECTORY, XDG_RUNTIME_DIR
                        where the default socket goes (the first that is set, else /tmp)
  LISTEN_FDS, LISTEN_PID, NOTIFY_SOCKET, WATCHDOG_USEC, JOURNAL_STREAM
                        set by systemd: socket activation, readiness and watchdog, and
                        journal priority prefixes on log lines
  KVP_NO_LIBURING=1     (at build time) build without the io_uring engine

exit status: 0 stopped cleanly, 1 could not serve (the log says why), 2 bad configuration.
"""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvprefetchd",
        description="Warm the heads of KV-cache files on request, over a Unix socket.",
        epilog=USAGE_TAIL,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    parser.add_argument(
        "--engine", choices=ENGINES,
        help="how workers read (auto: the queue of pread threads for read, fadvise for advise)",
    )
    parser.add_argument(
        "--warm-mode", choices=WARM_MODES, dest="warm_mode",
        help="read: read every head (what promotes a file on a tier); advise: hint the kernel",
    )
    parser.add_argument(
        "--read-bytes", type=int, metavar="N", dest="read_bytes",
        help="bytes warmed from the start of each file (a request may ask for fewer)",
    )
    parser.add_argument(
        "--metrics", metavar="ADDR",
        help='serve Prometheus metrics on ADDR: "127.0.0.1:9464", "[::1]:9464" or '
             f'"unix:/PATH" (default: ${METRICS_ENV}, else the config, else off)',
    )
    parser.add_argument(
        "--listen-tcp", metavar="ADDR:PORT", dest="listen_tcp",
        help="also listen on TCP, mutual TLS only (needs the certificate, key and CA files below)",
    )
    parser.add_argument("--tls-cert-file", metavar="PEM", dest="tls_cert_file",
                        help="the listener's certificate chain")
    parser.add_argument("--tls-key-file", metavar="PEM", dest="tls_key_file",
                        help="its private key")
    parser.add_argument("--tls-client-ca-file", metavar="PEM", dest="tls_client_ca_file",
                        help="the CA bundle client certificates must chain to")
    parser.add_argument(
        "--tls-allowed-client", metavar="ID", action="append", dest="tls_allowed_clients",
        help="a client identity let in: a SAN DNS or URI name (e.g. a SPIFFE ID), or a CN "
             "(repeatable; replaces the configured list)",
    )
    parser.add_argument("--log-level", choices=LOG_LEVELS, dest="log_level",
                        help="debug shows every refused path")
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
            ("listen_tcp", args.listen_tcp),
            ("tls_cert_file", args.tls_cert_file),
            ("tls_key_file", args.tls_key_file),
            ("tls_client_ca_file", args.tls_client_ca_file),
            ("tls_allowed_clients", args.tls_allowed_clients),
            ("metrics", args.metrics if args.metrics is not None else os.environ.get(METRICS_ENV)),
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
    except (HaltError, NoEngine, SocketInUse, TlsSetupError) as error:
        log.error("%s", error)
        return EXIT_HALTED
    except OSError as error:
        # Which socket failed, when the error knows (listening.listen_unix names it).
        where = error.filename if error.filename is not None else config.socket
        log.error("cannot serve on %s: %s", where, error.strerror or error)
        return EXIT_HALTED
