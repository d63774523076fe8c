"""The TCP listener's TLS context, made from the certificate files: at start and at each
SIGHUP, where a set that cannot make one is refused and the old context kept.

TLS 1.2 or newer, and a client certificate signed by `tls_client_ca_file` required (who
may connect is then decided by its identity: tcp.py, tls_identity.py).
"""

from __future__ import annotations

import ssl

from kvprefetchd.config import Config


class TlsSetupError(RuntimeError):
    """The certificate, key or CA files cannot make a server context."""


def server_context(config: Config) -> ssl.SSLContext | None:
    """The TLS context for the listener (None: plaintext on loopback)."""
    if config.tcp_plaintext_loopback:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
        context.load_verify_locations(cafile=config.tls_client_ca_file)
    except (OSError, ssl.SSLError) as error:
        raise TlsSetupError(f"TLS files (tls_cert_file, tls_key_file, tls_client_ca_file): "
                            f"{error}") from error
    return context
