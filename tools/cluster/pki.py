"""The local control plane's certificates: one CA, serving certificates for 127.0.0.1, client certificates for
each identity, and the service-account signing key (what controller-runtime's envtest generates too).

Usage (tools/cluster/plane.py does this):
    ca = Authority.create(run_dir / "pki")
    ca.serving("apiserver")                             # -> (cert path, key path), SANs 127.0.0.1 and localhost
    ca.client("alice", groups=("team-research",))       # a user whose name and groups the RBAC authorizer sees
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_FOR = dt.timedelta(days=7)


def _write_key(key, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


@dataclass(frozen=True)
class Authority:
    """A CA under `dir`: ca.crt and ca.key, and every certificate it issued beside them."""

    dir: Path

    @property
    def cert(self) -> Path:
        return self.dir / "ca.crt"

    @classmethod
    def create(cls, dir: Path) -> Authority:
        dir.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpu-train local control plane CA")])
        now = dt.datetime.now(dt.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + VALID_FOR)
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        _write_key(key, dir / "ca.key")
        (dir / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cls(dir)

    def _issue(self, name: str, subject: x509.Name, usage, sans: list | None) -> tuple[Path, Path]:
        ca_key = serialization.load_pem_private_key((self.dir / "ca.key").read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate(self.cert.read_bytes())
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + VALID_FOR)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        crt, pem = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, pem)
        return crt, pem

    def serving(self, name: str, hosts: tuple[str, ...] = ()) -> tuple[Path, Path]:
        """A server certificate valid for 127.0.0.1, localhost and `hosts` (DNS names)."""
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        sans = [x509.DNSName(h) for h in ("localhost", *hosts)]
        sans.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        return self._issue(name, subject, ExtendedKeyUsageOID.SERVER_AUTH, sans)

    def client(self, user: str, groups: tuple[str, ...] = ()) -> tuple[Path, Path]:
        """A client certificate: the API server reads the user from CN and the groups from O."""
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
        subject = x509.Name(attrs + [x509.NameAttribute(NameOID.COMMON_NAME, user)])
        safe = user.replace(":", "_")
        return self._issue(f"client-{safe}", subject, ExtendedKeyUsageOID.CLIENT_AUTH, None)

    def service_account_keys(self) -> tuple[Path, Path]:
        """The key pair the API server signs service-account tokens with: (public key, private key)."""
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pub, priv = self.dir / "sa.pub", self.dir / "sa.key"
        _write_key(key, priv)
        pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
        return pub, priv
