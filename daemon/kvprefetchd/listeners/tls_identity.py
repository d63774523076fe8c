"""A TLS client's identity, and the CA that vouched for it: what the TCP listener checks.

Identity, per RFC 6125 (section 6.4.4): a certificate that carries SAN names of the kinds
we match (DNS, URI: a SPIFFE ID is a URI) is named by those alone; its subject's CN
counts only when it has none. A CA that issues `CN=router, URI=spiffe://…/other` means
"other": 0.3.0 let such a certificate in as "router" (issue 23, finding 9).

Trust: which of `tls_client_ca_file`'s certificates a connection's chain ended at, kept
per connection (`trust_of`) so that a reload which drops that CA cuts the connection
(`trusted`). The chain OpenSSL verified is read with `get_verified_chain` (public since
Python 3.13; on 3.10-3.12 the same method of the private `_sslobj`, SSL_get0_verified_chain):
its last certificate is the trust anchor, compared by digest, so a CA replaced by another
with the same name still counts as removed. Where neither exists, the leaf's issuer name
is compared with the CAs' subject names instead (what `getpeercert` and `get_ca_certs`
give): weaker, a same-name replacement passes.
"""

from __future__ import annotations

import hashlib
import ssl
from typing import Any

DER = 2  # _ssl.ENCODING_DER: what _ssl.Certificate.public_bytes takes for DER


def identities(cert: dict[str, Any]) -> set[str]:
    """A verified client certificate's names: its SAN DNS and URI entries if it has any,
    else its subject's CN (RFC 6125 6.4.4)."""
    names = {value for kind, value in cert.get("subjectAltName", ()) if kind in ("DNS", "URI")}
    if names:
        return names
    return {value for rdn in cert.get("subject", ()) for key, value in rdn
            if key == "commonName"}


def _name_key(name: Any) -> bytes:
    """A distinguished name as getpeercert / get_ca_certs give it (tuples of RDNs)."""
    return b"name:" + repr(tuple(tuple(tuple(pair) for pair in rdn) for rdn in name)).encode()


def _anchor_key(der: bytes) -> bytes:
    return b"sha256:" + hashlib.sha256(der).digest()


def _verified_chain(sock: ssl.SSLSocket) -> list[bytes] | None:
    """The chain OpenSSL verified, leaf first, as DER; None where Python cannot tell."""
    public = getattr(sock, "get_verified_chain", None)  # Python 3.13
    if public is not None:
        return [bytes(cert) for cert in public()]
    private = getattr(getattr(sock, "_sslobj", None), "get_verified_chain", None)
    if private is None:
        return None
    chain = private()
    if chain is None:
        return None
    return [cert if isinstance(cert, bytes) else cert.public_bytes(DER) for cert in chain]


def trust_of(sock: ssl.SSLSocket) -> bytes | None:
    """Which CA vouched for the peer of a finished handshake: the digest of its chain's
    trust anchor, else (an older Python) its certificate's issuer name; None if unknown."""
    try:
        chain = _verified_chain(sock)
    except (AttributeError, TypeError, ValueError, ssl.SSLError):
        chain = None
    if chain:
        return _anchor_key(chain[-1])
    cert = sock.getpeercert()
    if cert and "issuer" in cert:
        return _name_key(cert["issuer"])
    return None


def trusted(context: ssl.SSLContext) -> frozenset[bytes]:
    """What `trust_of` may answer for a peer this context would verify now."""
    keys = {_anchor_key(der) for der in context.get_ca_certs(binary_form=True)}
    keys.update(_name_key(ca["subject"]) for ca in context.get_ca_certs() if "subject" in ca)
    return frozenset(keys)
