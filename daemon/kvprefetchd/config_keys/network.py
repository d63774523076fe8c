"""Config keys: the TCP listener with mutual TLS, for routers on other hosts (tcp.py)."""

from __future__ import annotations

from kvprefetchd.config_keys.key import BOOL, INT, NAMES, SECONDS_OR_OFF, TEXT, Flag, Key, Section

TCP = Section("TCP with mutual TLS (routers on other hosts)", (
    Key("listen_tcp", TEXT, "", restart=True,
        flag=Flag("--listen-tcp", "also listen on TCP, mutual TLS only (needs the "
                  "certificate, key and CA files below)", "ADDR:PORT"), help="""
        Off unless set. A daemon on a GPU node listens where the router can reach it; every
        client presents a certificate signed by tls_client_ca_file whose SAN DNS or URI name
        (e.g. a SPIFFE ID) is listed in tls_allowed_clients, or, for a certificate without such
        names, whose CN is (RFC 6125; empty list: any the CA signed).
        The files are read again on SIGHUP (cert-manager rotates them); a set that does not
        load is refused and the old one kept; connections whose CA the new CA file no longer
        holds are cut. The shipped unit allows only localhost
        (IPAddressAllow=localhost): add the router's addresses in a drop-in. For example
        "10.0.0.7:7474", the files of a cert-manager Secret mounted at /etc/kvprefetchd/tls
        (tls.crt, tls.key, ca.crt), and ["spiffe://cluster.local/ns/llm-d/sa/router"]."""),
    Key("tls_cert_file", TEXT, "",
        flag=Flag("--tls-cert-file", "the listener's certificate chain", "PEM")),
    Key("tls_key_file", TEXT, "", flag=Flag("--tls-key-file", "its private key", "PEM")),
    Key("tls_client_ca_file", TEXT, "",
        flag=Flag("--tls-client-ca-file", "the CA bundle client certificates must chain to",
                  "PEM")),
    Key("tls_allowed_clients", NAMES, (),
        flag=Flag("--tls-allowed-client", "a client identity let in: a SAN DNS or URI name "
                  "(e.g. a SPIFFE ID), or a CN (repeatable; replaces the configured list)",
                  "ID")),
    Key("tls_handshake_timeout", SECONDS_OR_OFF, 5.0, bounds=(0.1, 600.0)),
    Key("max_connections_per_address", INT, 64, bounds=(1, 65536)),
    Key("max_tls_handshakes", INT, 64, bounds=(1, 65536), help="""
        Handshakes in progress have slots of their own, apart from max_connections (which only
        a listed identity reaches over TLS); when all are taken, a newcomer displaces the oldest
        handshake of the address holding the most, if it holds more than the newcomer's own.
        New handshakes are rate-limited (token buckets, a second's worth at once): per address,
        and for every address no listed router connected from before, together; a connection
        over a rate is closed before its handshake, and its client retries."""),
    Key("tls_handshake_rate", INT, 50, bounds=(1, 1_000_000)),
    Key("tls_handshake_rate_per_address", INT, 32, bounds=(1, 1_000_000)),
    Key("tcp_plaintext_loopback", BOOL, False, restart=True, help="""
        Plaintext TCP, refused except on loopback: for tests only."""),
))
