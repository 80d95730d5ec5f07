"""Transport security: TLS for clients, mutual TLS between the coordinator and workers, and
a development CA (`specdec certs`) to try it with.

A worker started with a client CA demands a client certificate signed by it and refuses any
peer without one; the coordinator presents its own certificate to the workers. Plaintext is
allowed without asking only on a loopback address; anywhere else it takes `--insecure`, and
it is logged as a warning every time a server starts that way.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc

from specdec.errors import FailedPrecondition

log = logging.getLogger(__name__)

CERT_DAYS = 365
KEY_BITS = 2048


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate, and the CA its clients must present certificates from."""

    cert: Path | None = None
    key: Path | None = None
    client_ca: Path | None = None
    """When set, clients must present a certificate signed by this CA (mutual TLS)."""

    @property
    def enabled(self) -> bool:
        return self.cert is not None

    def credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise FailedPrecondition("TLS needs both a certificate and its key (--tls-cert, --tls-key)")
        pair = [(_read(self.key), _read(self.cert))]
        if self.client_ca is None:
            return grpc.ssl_server_credentials(pair)
        return grpc.ssl_server_credentials(pair, root_certificates=_read(self.client_ca),
                                           require_client_auth=True)


@dataclass(frozen=True)
class ClientTLS:
    """How a client (the CLI, or the coordinator calling workers) reaches a TLS server."""

    ca: Path | None = None
    """CA that signed the server's certificate."""
    cert: Path | None = None
    """This client's certificate, for servers that demand one (mutual TLS)."""
    key: Path | None = None
    server_name: str | None = None
    """The name the server's certificate must cover, instead of the host dialed: the
    coordinator dials worker pods by IP, and checks each against the name of their Service."""

    @property
    def enabled(self) -> bool:
        return self.ca is not None

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise FailedPrecondition("a client certificate needs its key, and a key its certificate")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca) if self.ca else None,
            private_key=_read(self.key) if self.key else None,
            certificate_chain=_read(self.cert) if self.cert else None,
        )


def _read(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise FailedPrecondition(f"cannot read {path}: {exc.strerror}") from exc


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_plaintext_allowed(host: str, insecure: bool, what: str) -> None:
    """Refuses plaintext off loopback unless asked for, and says so loudly when it is."""
    if insecure:
        log.warning("INSECURE: %s serves plaintext on %s (--insecure): no encryption, no peer "
                    "authentication. Use --tls-cert/--tls-key (and --tls-client-ca for workers) in production.",
                    what, host)
    elif not is_loopback(host):
        raise FailedPrecondition(
            f"{what} would serve plaintext on {host}: give --tls-cert and --tls-key (workers also "
            "--tls-client-ca), or --insecure to accept plaintext explicitly"
        )


def channel(address: str, tls: ClientTLS | None, options: list) -> grpc.aio.Channel:
    if tls is not None and tls.enabled:
        if tls.server_name:
            # The certificate is checked against server_name (and TLS SNI and :authority carry
            # it) whatever address is dialed.
            options = [*options, ("grpc.ssl_target_name_override", tls.server_name),
                       ("grpc.default_authority", tls.server_name)]
        return grpc.aio.secure_channel(address, tls.credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)


# --- a development CA ---------------------------------------------------------------------


def make_dev_certs(out: Path, hosts: list[str]) -> dict[str, Path]:
    """Writes ca.pem/ca.key, server.pem/server.key (SANs: hosts + localhost + 127.0.0.1) and
    client.pem/client.key (for the coordinator's mTLS to workers) under `out`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def key():
        return rsa.generate_private_key(public_exponent=65537, key_size=KEY_BITS)

    def name(common: str):
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "specdec dev"),
                          x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write(stem: str, cert, private) -> None:
        (out / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path = out / f"{stem}.key"
        key_path.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
        key_path.chmod(0o600)

    ca_key = key()
    ca = (x509.CertificateBuilder().subject_name(name("specdec dev CA")).issuer_name(name("specdec dev CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    write("ca", ca, ca_key)

    def leaf(stem: str, common: str, usage, sans: list[str]) -> None:
        private = key()
        builder = (x509.CertificateBuilder().subject_name(name(common)).issuer_name(ca.subject)
                   .public_key(private.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if sans:
            entries = []
            for host in sans:
                try:
                    entries.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    entries.append(x509.DNSName(host))
            builder = builder.add_extension(x509.SubjectAlternativeName(entries), critical=False)
        write(stem, builder.sign(ca_key, hashes.SHA256()), private)

    server_hosts = list(dict.fromkeys([*hosts, "localhost", "127.0.0.1"]))
    leaf("server", server_hosts[0], ExtendedKeyUsageOID.SERVER_AUTH, server_hosts)
    leaf("client", "specdec-coordinator", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    return {stem: out / f"{stem}.pem" for stem in ("ca", "server", "client")}
