"""Certificates made on the fly for the TLS tests and benchmarks (never committed).

A CA, and leaf certificates it signs: a server's (SAN 127.0.0.1, ::1, localhost and any
address given) and clients' (a SPIFFE-style URI SAN and a CN), optionally expired, or
signed by another CA. Files are PEM, keys unencrypted, in the directory given.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


@dataclass(frozen=True)
class CA:
    cert: Path
    key: Path
    name: str

    def _loaded(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        cert = x509.load_pem_x509_certificate(self.cert.read_bytes())
        key = serialization.load_pem_private_key(self.key.read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return cert, key


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write(directory: Path, stem: str, cert: x509.Certificate,
           key: ec.EllipticCurvePrivateKey) -> Issued:
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return Issued(cert_path, key_path)


def make_ca(directory: Path, name: str = "kvprefetch test CA") -> CA:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                     False), critical=True)
        .sign(key, hashes.SHA256())
    )
    issued = _write(directory, name.replace(" ", "_"), cert, key)
    return CA(issued.cert, issued.key, name)


def issue(ca: CA, directory: Path, stem: str, *, common_name: str, server: bool = False,
          dns: tuple[str, ...] = (), uris: tuple[str, ...] = (), ips: tuple[str, ...] = (),
          expired: bool = False) -> Issued:
    ca_cert, ca_key = ca._loaded()
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns]
    names += [x509.UniformResourceIdentifier(u) for u in uris]
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
    start = _now() - datetime.timedelta(days=10 if expired else 0, minutes=5)
    end = _now() - datetime.timedelta(days=1) if expired else _now() + datetime.timedelta(days=7)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return _write(directory, stem, builder.sign(ca_key, hashes.SHA256()), key)


def server_cert(ca: CA, directory: Path, *addresses: str) -> Issued:
    return issue(ca, directory, "server", common_name="kvprefetchd", server=True,
                 dns=("localhost",), ips=("127.0.0.1", "::1", *addresses))
