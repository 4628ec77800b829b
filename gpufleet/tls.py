"""The gateway's TLS certificate on the controller: a site's pair checked, or a self-signed
pair made once and kept, atomically, like the API key (gpufleet.apikey).

The self-signed certificate is its own CA: clients trust it (`fab endpoint` prints its path),
and it names every gateway of the deployment (their inventory names and addresses) as
subject alternative names. It is made again only when it no longer names a gateway or
ends within RENEW_DAYS; the deploy then says the CA changed.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import stat

from gpufleet import apikey

VALID_DAYS = 825  # the longest a public CA may issue; clients accept it
RENEW_DAYS = 30


class TLSError(apikey.KeyFileError):
    """A certificate or key that cannot be used: what is wrong and the fix."""


def _x509():
    from cryptography import x509

    return x509


def _load(cert_pem: bytes, where: str):
    try:
        return _x509().load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise TLSError(f"{where} is not a PEM certificate ({exc})",
                       "name a PEM file (-----BEGIN CERTIFICATE-----)") from None


def _names(cert) -> set[str]:
    x509 = _x509()
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return ({str(n) for n in san.get_values_for_type(x509.DNSName)}
            | {str(a) for a in san.get_values_for_type(x509.IPAddress)})


def _read(path: str, what: str, private: bool) -> bytes:
    where = f"TLS {what} file {path}"
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise TLSError(f"{where} is not a regular file", f"name the {what}'s file")
        if private and st.st_mode & 0o077:
            raise TLSError(f"{where} is readable by others (mode {stat.S_IMODE(st.st_mode):04o})",
                           f"`chmod 600 {path}`")
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise TLSError(f"{where}: {exc.strerror}",
                       "make it readable by the controller user") from None


def check_pair(cert_pem: bytes, key_pem: bytes, where: str, names=()) -> list[str]:
    """Problems with a certificate (the first of a chain) and its key: not PEM, the key not
    the certificate's, expired, or missing one of NAMES; [] when it can serve them."""
    from cryptography.hazmat.primitives import serialization

    cert = _load(cert_pem, where)
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise TLSError(f"the key of {where} is not an unencrypted PEM private key ({exc})",
                       "name the certificate's key, without a passphrase (nginx reads it "
                       "unattended)") from None
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    enc = serialization.Encoding.DER
    problems = []
    if key.public_key().public_bytes(enc, pub) != cert.public_key().public_bytes(enc, pub):
        problems.append(f"the key of {where} does not belong to its certificate")
    if cert.not_valid_after_utc <= datetime.datetime.now(datetime.UTC):
        problems.append(f"{where} expired on {cert.not_valid_after_utc:%Y-%m-%d}")
    missing = sorted(set(names) - _names(cert))
    if missing:
        problems.append(f"{where} does not name {', '.join(missing)} (its names: "
                        f"{', '.join(sorted(_names(cert))) or 'none'})")
    return problems


def read_site_pair(cert_path: str, key_path: str, names=()) -> tuple[str, str]:
    """A site's certificate (chain) and key, checked; TLSError naming what is wrong."""
    cert, key = _read(cert_path, "certificate", False), _read(key_path, "key", True)
    problems = check_pair(cert, key, f"certificate {cert_path}", names)
    if problems:
        raise TLSError("; ".join(problems), "give a certificate and its key that name every "
                       "gateway host (gpufleet_tls_cert_file, gpufleet_tls_key_file), or set "
                       "neither for a self-signed pair gpufleet makes")
    return cert.decode(), key.decode()


def _make(names: list[str]) -> tuple[str, str]:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    x509 = _x509()
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64]),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gpufleet")])
    alt = []
    for name in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM).decode(),
            key.private_bytes(serialization.Encoding.PEM,
                              serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()).decode())


def _usable(cert_pem: str, key_pem: str, names: list[str]) -> bool:
    try:
        if check_pair(cert_pem.encode(), key_pem.encode(), "the certificate", names):
            return False
    except TLSError:
        return False
    ends = _load(cert_pem.encode(), "the certificate").not_valid_after_utc
    return ends - datetime.datetime.now(datetime.UTC) > datetime.timedelta(
        days=RENEW_DAYS)


def ensure_self_signed(cert_path: str, key_path: str, names: list[str],
                       on_host: tuple[str, str] | None = None) -> dict:
    """The deployment's self-signed pair: the controller's where it names every gateway
    (NAMES) and is not about to end; else the pair the gateway host already serves with,
    where it does (kept, so that a new controller changes nothing for clients); else a new
    one, written 0600 like the API key. Returns cert, key and `made` (a new CA)."""
    with apikey.made_once(cert_path):
        return _ensure(cert_path, key_path, names, on_host)


def _ensure(cert_path, key_path, names, on_host):
    have = None
    if os.path.lexists(cert_path) and os.path.lexists(key_path):
        have = (_read(cert_path, "certificate", False).decode(),
                _read(key_path, "key", True).decode())
    for pair in (have, on_host):
        if pair and all(pair) and _usable(pair[0], pair[1], names):
            if pair is not have:
                apikey.write(key_path, pair[1].strip())
                apikey.write(cert_path, pair[0].strip())
            return {"cert": pair[0], "key": pair[1], "made": False}
    cert, key = _make(names)
    apikey.write(key_path, key.strip())
    apikey.write(cert_path, cert.strip())
    return {"cert": cert, "key": key, "made": True}


def read_ca(path: str) -> str:
    """A CA file clients verify the gateway with: PEM certificates, checked."""
    text = _read(path, "CA", False)
    _load(text, f"TLS CA file {path}")
    return text.decode()
