"""The TLS of the agent's HTTP port with ``--metrics-secure``: a certificate and key from PEM files
(``--tls-cert-file``, ``--tls-private-key-file``: a ``kubernetes.io/tls`` Secret mounted into the
pod, as cert-manager writes them), re-read when they change; or, without them, a self-signed
certificate made at start (ECDSA P-256, for a year, renewed a month before it ends), which a
scraper accepts with ``insecure_skip_verify`` (a ServiceMonitor's ``tlsConfig``).

TLS 1.2 at least, ``http/1.1`` by ALPN; no client certificates are asked for (the caller
proves who it is with its bearer token: :mod:`.kubeauth`).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import shutil
import ssl
import tempfile
import threading

from .clock import REAL_TIME, Clock

log = logging.getLogger("nftpolicy.agent")

CHECK_INTERVAL = 10.0  # seconds between two looks at the certificate files (or the self-signed one's end)
SELF_SIGNED_DAYS = 365
RENEW_DAYS = 30  # a self-signed certificate is made again this many days before it ends


class CertificateError(Exception):
    """The certificate or key cannot be read or do not fit (one line: the files and the reason)."""


def _context(cert_file: str, key_file: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    try:
        context.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:  # before OSError, its base
        raise CertificateError(f"cannot use the certificate {cert_file} with the key {key_file}: not a PEM certificate (chain) "
                               f"and its private key, or they do not match (OpenSSL: {exc.reason or exc.library or exc})") from None
    except OSError as exc:
        raise CertificateError(f"cannot use the certificate {cert_file} with the key {key_file}: {exc.strerror or exc}") from None
    return context


def self_signed(names: list[str]) -> tuple[bytes, bytes, datetime.datetime]:
    """A new self-signed certificate for ``names`` (DNS names or IP addresses; the first is its
    common name) and its key, as PEM, and when it ends."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    ends = now + datetime.timedelta(days=SELF_SIGNED_DAYS)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64])])
    alternative: list[x509.GeneralName] = []
    for name in names:
        try:
            alternative.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alternative.append(x509.DNSName(name))
    certificate = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(ends).add_extension(x509.SubjectAlternativeName(alternative), critical=False)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                   .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return certificate.public_bytes(serialization.Encoding.PEM), key_pem, ends


class ServingCertificate:
    """The TLS context of each new connection (call it): from ``cert_file`` and ``key_file``, or,
    when both are None, self-signed for ``names``. Raises CertificateError at once when the
    files cannot be used. Files that change later (a Secret's rotation) are read again at the
    next connection after :data:`CHECK_INTERVAL`; a change that cannot be used keeps the
    certificate in use, with one warning. Thread-safe."""

    def __init__(self, cert_file: str | None, key_file: str | None, names: list[str], clock: Clock = REAL_TIME) -> None:
        self.cert_file, self.key_file, self.names, self.clock = cert_file, key_file, names, clock
        self._lock = threading.Lock()
        self._seen = self._stamp()
        self._ends: datetime.datetime | None = None
        self._current = self._load()
        self._checked = clock.now()

    def _stamp(self) -> tuple[tuple[int, int, int], ...]:
        stamps = []
        for path in (self.cert_file, self.key_file):
            try:
                info = os.stat(path) if path else None
            except OSError:
                info = None
            stamps.append((info.st_ino, info.st_size, info.st_mtime_ns) if info else (0, 0, 0))
        return tuple(stamps)

    def _load(self) -> ssl.SSLContext:
        if self.cert_file and self.key_file:
            return _context(self.cert_file, self.key_file)
        cert, key, self._ends = self_signed(self.names)
        directory = tempfile.mkdtemp(prefix="nftpolicy-tls-")  # mode 0700; the key lives there for a moment only
        try:
            for name, data in (("tls.crt", cert), ("tls.key", key)):
                with open(os.path.join(directory, name), "wb") as out:
                    out.write(data)
            return _context(os.path.join(directory, "tls.crt"), os.path.join(directory, "tls.key"))
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def __call__(self) -> ssl.SSLContext:
        with self._lock:
            if self.clock.now() - self._checked < CHECK_INTERVAL:
                return self._current
            self._checked = self.clock.now()
            stamp = self._stamp()
            renew = self._ends is not None and self._ends - datetime.datetime.now(datetime.timezone.utc) < datetime.timedelta(days=RENEW_DAYS)
            if stamp != self._seen or renew:
                self._seen = stamp
                try:
                    self._current = self._load()
                    log.info("serving certificate %s", f"read again from {self.cert_file}" if self.cert_file else "made again")
                except CertificateError as exc:
                    log.warning("%s; serving the certificate read before", exc)
            return self._current
