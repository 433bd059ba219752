"""The fleet's trust: a certificate authority on the gateway, join tokens, and each member's identity.

- ``Authority`` (gateway side, a 0700 directory of 0600 files): the fleet CA, the gateway's own
  certificate, the local operator's certificate, join tokens (only their hashes are kept), the
  certificates issued and the revoked ones. Every change is a locked read-modify-write, so
  `edgetrain token new` or `edgetrain boards revoke` in another process takes effect at once.
- ``JoinToken``: ``<id>.<secret>.<CA fingerprint>`` — a one-time secret plus the SHA-256 of the
  CA certificate, so a board verifies the gateway before it sends anything (as `kubeadm join`
  carries the CA hash).
- ``Identity``: a private key, its certificate and the fleet CA — what a board, the gateway or an
  operator authenticates with (``Identity.security()`` is its mutual-TLS transport Security).
- ``make_csr`` / ``Authority.sign``: a board's key never leaves the board; the gateway signs a
  certificate request whose name it checks.

Every certificate names its holder (common name) and role (organizational unit: gateway, board or
operator). Keys and certificates are made with `cryptography`; nothing here implements crypto.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

GATEWAY, BOARD, OPERATOR = "gateway", "board", "operator"
ROLES = (GATEWAY, BOARD, OPERATOR)
GATEWAY_SERVER_NAME = "gateway.edgetrain"
"""The DNS name in the gateway's certificate: clients verify the coordinator against it."""
BOARD_SERVER_NAME = "board.edgetrain"
"""The DNS name in every board's certificate: boards and the coordinator verify a StagePeer
against it (only a board of the fleet can serve one; which board, the callee checks)."""

CA_DAYS = 3650
GATEWAY_DAYS = 825
OPERATOR_DAYS = 365
BOARD_DAYS = 30.0
"""Board certificates are short-lived and renew themselves (see ``Identity.needs_renewal``)."""
RENEW_FRACTION = 1 / 3
"""A certificate renews when less than this fraction of its lifetime is left."""
TOKEN_TTL_S = 24 * 3600.0
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_TOKEN_PATTERN = re.compile(r"^([a-z0-9]{6})\.([a-z0-9]{16})\.([0-9a-f]{64})$")
_TOKEN_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


class TrustError(Exception):
    """A credential problem, said in one line (bad token, wrong fleet, expired certificate, ...)."""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` readable by its owner only (atomically)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def new_key() -> ec.EllipticCurvePrivateKey:
    """A fresh P-256 private key (fast to make and to handshake with on a small board)."""
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def fingerprint(cert: x509.Certificate) -> str:
    """SHA-256 of the certificate's DER encoding, lowercase hex (what a join token pins)."""
    return cert.fingerprint(hashes.SHA256()).hex()


def check_name(name: str) -> str:
    """`name` if it can name a fleet member (a hostname-like word), else ValueError."""
    if not NAME_PATTERN.match(name or ""):
        raise ValueError(f"{name!r} cannot name a fleet member: use letters, digits, '.', '_' or '-' "
                         "(at most 63, starting with a letter or digit)")
    return name


def _subject(name: str, role: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name),
                      x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role)])


def make_csr(key: ec.EllipticCurvePrivateKey, name: str) -> bytes:
    """A certificate signing request (PEM) for `name`, signed by `key`."""
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, check_name(name))]))
           .sign(key, hashes.SHA256()))
    return csr.public_bytes(serialization.Encoding.PEM)


def read_csr(pem: bytes) -> tuple[str, ec.EllipticCurvePublicKey]:
    """The name and public key of a signing request, after checking its signature (ValueError)."""
    try:
        csr = x509.load_pem_x509_csr(pem)
    except ValueError as e:
        raise ValueError(f"not a PEM certificate signing request: {e}") from None
    if not csr.is_signature_valid:
        raise ValueError("the certificate signing request's signature does not verify")
    names = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(names) != 1:
        raise ValueError("the certificate signing request must carry exactly one common name")
    public_key = csr.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey):
        raise ValueError("the certificate signing request's key must be an elliptic-curve key")
    return check_name(str(names[0].value)), public_key


@dataclass(frozen=True)
class Holder:
    """Who a certificate belongs to: its name, role, serial number and expiry."""

    name: str
    role: str
    serial: int
    not_after: dt.datetime


def holder_of(cert: x509.Certificate) -> Holder:
    """The holder a fleet certificate names (ValueError when it names none)."""
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ou = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    if not cn or not ou or ou[0].value not in ROLES:
        raise ValueError("not a fleet certificate: it names no member and role")
    return Holder(str(cn[0].value), str(ou[0].value), cert.serial_number, cert.not_valid_after_utc)


# --- join tokens ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class JoinToken:
    """A join token: which token (id), its one-time secret, and the fleet CA's fingerprint."""

    token_id: str
    secret: str
    ca_fingerprint: str

    def __str__(self) -> str:
        return f"{self.token_id}.{self.secret}.{self.ca_fingerprint}"

    @classmethod
    def parse(cls, text: str) -> JoinToken:
        """A token from its text (TrustError with what is wrong)."""
        match = _TOKEN_PATTERN.match(text.strip())
        if not match:
            raise TrustError("malformed join token: expected <6 chars>.<16 chars>.<64 hex digits> "
                             "(from `edgetrain token new` on the gateway)")
        return cls(*match.groups())


def _hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


# --- identities -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Identity:
    """A member's private key (PEM), certificate (PEM) and the fleet CA certificate (PEM)."""

    key: bytes
    cert: bytes
    ca: bytes

    @property
    def holder(self) -> Holder:
        return holder_of(x509.load_pem_x509_certificate(self.cert))

    @property
    def ca_fingerprint(self) -> str:
        return fingerprint(x509.load_pem_x509_certificate(self.ca))

    def expired(self, now: dt.datetime | None = None) -> bool:
        return (now or _now()) >= self.holder.not_after

    def needs_renewal(self, now: dt.datetime | None = None) -> bool:
        """Less than RENEW_FRACTION of the certificate's lifetime is left."""
        cert = x509.load_pem_x509_certificate(self.cert)
        lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
        return (now or _now()) >= cert.not_valid_after_utc - lifetime * RENEW_FRACTION

    def security(self, server_name: str = GATEWAY_SERVER_NAME, *, require_client_auth: bool = True):
        """This identity's mutual-TLS Security, dialing servers that must prove `server_name`."""
        from edgetrain.transport import MutualTLS

        return MutualTLS(self, server_name=server_name, require_client_auth=require_client_auth)

    # storage: a directory (key.pem, cert.pem, ca.pem) or one bundle file holding all three
    def save(self, path: Path) -> Path:
        path = Path(path)
        if path.suffix == ".pem":
            _private_dir(path.parent)
            _write_private(path, self.key + self.cert + self.ca)
            return path
        _private_dir(path)
        for file, data in (("key.pem", self.key), ("cert.pem", self.cert), ("ca.pem", self.ca)):
            _write_private(path / file, data)
        return path

    @classmethod
    def exists(cls, path: Path) -> bool:
        path = Path(path)
        return path.is_file() or (path / "cert.pem").is_file()

    @classmethod
    def load(cls, path: Path) -> Identity:
        """An identity from a directory or a bundle file (TrustError when missing or unreadable)."""
        path = Path(path)
        try:
            if path.is_file():
                text = path.read_bytes()
                pems = [m.group(0) for m in re.finditer(rb"-----BEGIN ([A-Z ]+)-----.*?-----END \1-----\n?",
                                                        text, re.S)]
                keys = [p for p in pems if b"PRIVATE KEY" in p]
                certs = [p for p in pems if b"CERTIFICATE" in p]
                if len(keys) != 1 or len(certs) != 2:
                    raise TrustError(f"{path}: a credential bundle holds one private key and two certificates")
                return cls(keys[0], certs[0], certs[1])
            return cls((path / "key.pem").read_bytes(), (path / "cert.pem").read_bytes(),
                       (path / "ca.pem").read_bytes())
        except FileNotFoundError:
            raise TrustError(f"no fleet credentials at {path}") from None
        except OSError as e:
            raise TrustError(f"cannot read fleet credentials at {path}: {e.strerror}") from None


# --- the authority --------------------------------------------------------------------------------

def default_home() -> Path:
    """Where EdgeTrain keeps credentials: $EDGETRAIN_HOME, else ~/.edgetrain."""
    return Path(os.environ.get("EDGETRAIN_HOME") or Path.home() / ".edgetrain")


def default_authority_dir() -> Path:
    return default_home() / "authority"


def default_identity_path(name: str) -> Path:
    """Where board `name` keeps its key and certificate by default (one directory per name, so
    emulated boards on one machine keep theirs apart)."""
    return default_home() / "boards" / name


def _validity(days: float) -> tuple[dt.datetime, dt.datetime]:
    start = _now() - dt.timedelta(minutes=5)  # a board's clock a little behind still accepts it
    return start, _now() + dt.timedelta(days=days)


class Authority:
    """The fleet CA and its records in `directory` (made by ``Authority.create``)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        try:
            self._ca_key = serialization.load_pem_private_key((self.directory / "ca.key").read_bytes(), None)
            self.ca_cert = x509.load_pem_x509_certificate((self.directory / "ca.crt").read_bytes())
        except FileNotFoundError:
            raise TrustError(f"no fleet authority at {self.directory} (run `edgetrain init`)") from None
        self.ca_pem = cert_pem(self.ca_cert)
        self.fingerprint = fingerprint(self.ca_cert)
        self._revoked_mtime: float | None = None
        self._revoked: set[int] = set()

    @classmethod
    def create(cls, directory: Path, *, fleet: str = "edgetrain") -> Authority:
        """A new fleet CA with the gateway's and the local operator's certificates."""
        directory = _private_dir(Path(directory))
        if (directory / "ca.crt").exists():
            raise TrustError(f"a fleet authority already exists at {directory}")
        key = new_key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{fleet} fleet CA")])
        start, end = _validity(CA_DAYS)
        ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
              .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                           content_commitment=False, key_encipherment=False,
                                           data_encipherment=False, key_agreement=False, encipher_only=False,
                                           decipher_only=False), critical=True)
              .sign(key, hashes.SHA256()))
        _write_private(directory / "ca.key", key_pem(key))
        _write_private(directory / "ca.crt", cert_pem(ca))
        for records in ("tokens.json", "certificates.json", "revoked.json"):
            _write_private(directory / records, b"{}" if records != "revoked.json" else b'{"serials": [], "names": {}}')
        authority = cls(directory)
        authority.issue_identity("gateway", GATEWAY).save(directory / "gateway")
        authority.issue_identity(f"operator-{_hostname()}", OPERATOR).save(directory / "operator")
        return authority

    @classmethod
    def open_or_create(cls, directory: Path) -> tuple[Authority, bool]:
        """The authority at `directory`, made first if there is none; and whether it was made."""
        with contextlib.suppress(TrustError):
            return cls(directory), False
        return cls.create(directory), True

    # -- locked records --
    @contextlib.contextmanager
    def _records(self, name: str) -> Iterator[dict]:
        """The JSON records file `name`, locked against other processes, written back on exit."""
        lock_path = self.directory / ".lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            path = self.directory / name
            records = json.loads(path.read_text()) if path.exists() else {}
            yield records
            _write_private(path, json.dumps(records, indent=1, sort_keys=True).encode())
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _read(self, name: str) -> dict:
        path = self.directory / name
        return json.loads(path.read_text()) if path.exists() else {}

    # -- certificates --
    def _sign(self, name: str, role: str, public_key, days: float) -> x509.Certificate:
        check_name(name)
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        start, end = _validity(days)
        server_name = GATEWAY_SERVER_NAME if role == GATEWAY else BOARD_SERVER_NAME
        builder = (x509.CertificateBuilder().subject_name(_subject(name, role)).issuer_name(self.ca_cert.subject)
                   .public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH,
                                                         ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
        if role != OPERATOR:  # operators only dial; gateways and boards also serve
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(server_name)]), critical=False)
        cert = builder.sign(self._ca_key, hashes.SHA256())
        with self._records("certificates.json") as issued:
            issued[str(cert.serial_number)] = {"name": name, "role": role, "issued": time.time(),
                                               "not_after": cert.not_valid_after_utc.timestamp()}
        return cert

    def issue_identity(self, name: str, role: str, days: float | None = None) -> Identity:
        """A key and certificate made here (the gateway's own, or an operator's for a laptop)."""
        key = new_key()
        days = days if days is not None else {GATEWAY: GATEWAY_DAYS, OPERATOR: OPERATOR_DAYS}.get(role, BOARD_DAYS)
        return Identity(key_pem(key), cert_pem(self._sign(name, role, key.public_key(), days)), self.ca_pem)

    def sign(self, csr: bytes, *, role: str = BOARD, days: float = BOARD_DAYS, name: str | None = None) -> bytes:
        """A certificate (PEM) for a signing request; `name`, when given, must be the request's."""
        requested, public_key = read_csr(csr)
        if name is not None and requested != name:
            raise PermissionError(f"a certificate for {name} cannot be renewed as {requested}")
        if role == BOARD and requested in self.revoked_names():
            raise PermissionError(f"board {requested} was revoked; it needs a new join token")
        return cert_pem(self._sign(requested, role, public_key, days))

    def gateway_identity(self) -> Identity:
        return Identity.load(self.directory / "gateway")

    def operator_identity(self) -> Identity:
        return Identity.load(self.directory / "operator")

    def certificates(self) -> dict[int, dict]:
        return {int(serial): record for serial, record in self._read("certificates.json").items()}

    # -- revocation --
    def revoke(self, name: str) -> list[int]:
        """Revoke every certificate issued to `name`; returns their serials."""
        serials = [s for s, r in self.certificates().items() if r["name"] == name]
        if not serials:
            raise TrustError(f"no certificate was issued to {name!r}")
        with self._records("revoked.json") as revoked:
            revoked["serials"] = sorted(set(revoked.get("serials", [])) | set(serials))
            revoked.setdefault("names", {})[name] = time.time()
        return serials

    def readmit(self, name: str) -> None:
        """Let a revoked name pair again (with a new token); its old certificates stay revoked."""
        with self._records("revoked.json") as revoked:
            revoked.setdefault("names", {}).pop(name, None)

    def revoked_names(self) -> set[str]:
        return set(self._read("revoked.json").get("names", {}))

    def is_revoked(self, serial: int) -> bool:
        """Whether certificate `serial` was revoked (the file is re-read when it changes)."""
        path = self.directory / "revoked.json"
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            return False
        if mtime != self._revoked_mtime:
            self._revoked = set(json.loads(path.read_text()).get("serials", []))
            self._revoked_mtime = mtime
        return serial in self._revoked

    # -- tokens --
    def new_token(self, *, ttl_s: float = TOKEN_TTL_S, uses: int = 1, note: str = "") -> JoinToken:
        """A join token that admits `uses` boards within `ttl_s` seconds."""
        if uses < 1 or ttl_s <= 0:
            raise ValueError("a token needs at least one use and a positive lifetime")
        token = JoinToken("".join(secrets.choice(_TOKEN_ALPHABET) for _ in range(6)),
                          "".join(secrets.choice(_TOKEN_ALPHABET) for _ in range(16)), self.fingerprint)
        with self._records("tokens.json") as tokens:
            tokens[token.token_id] = {"secret_sha256": _hash_secret(token.secret), "expires": time.time() + ttl_s,
                                      "uses_left": uses, "note": note, "created": time.time(), "used_by": []}
        return token

    def tokens(self) -> dict[str, dict]:
        """Token id -> its record (no secret: only its hash is kept)."""
        return self._read("tokens.json")

    def revoke_token(self, token_id: str) -> None:
        with self._records("tokens.json") as tokens:
            if tokens.pop(token_id, None) is None:
                raise TrustError(f"no token {token_id!r}")

    def redeem(self, token_id: str, secret: str, board: str) -> None:
        """Spend one use of a token for `board` (PermissionError when it is wrong, used or expired)."""
        with self._records("tokens.json") as tokens:
            record = tokens.get(token_id)
            if record is None or not hmac.compare_digest(record["secret_sha256"], _hash_secret(secret)):
                raise PermissionError("unknown join token or wrong secret")
            if record["expires"] < time.time():
                raise PermissionError("the join token has expired; make a new one with `edgetrain token new`")
            if record["uses_left"] < 1:
                raise PermissionError("the join token was already used; make a new one with `edgetrain token new`")
            record["uses_left"] -= 1
            record["used_by"].append(board)


def _hostname() -> str:
    import socket

    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:50].strip(".-_")
    return name or "gateway"


def verify_issued_by(cert_pem_bytes: bytes, ca: x509.Certificate) -> None:
    """TrustError unless the certificate was signed by `ca`."""
    try:
        x509.load_pem_x509_certificate(cert_pem_bytes).verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise TrustError("the certificate was not issued by the fleet CA") from None


# --- what each command authenticates with ---------------------------------------------------------

INSECURE_WARNING = ("WARNING: --insecure: no authentication and no encryption; anyone who can reach "
                    "this port can join, read and change the training. Use it only on loopback or a "
                    "network you made for the experiment.")


def gateway_authority(directory: Path | None, *, insecure: bool = False) -> Authority | None:
    """The authority a coordinator or job server serves under: the one at `directory` (default
    ~/.edgetrain/authority), made on first start; None with `insecure` (after the warning)."""
    import logging
    import sys

    if insecure:
        print(INSECURE_WARNING, file=sys.stderr, flush=True)
        return None
    authority, made = Authority.open_or_create(directory or default_authority_dir())
    if made:
        token = authority.new_token(note="made by the first start")
        logging.getLogger(__name__).info(
            "[Gateway] made a fleet authority in %s (CA %s…); pair a board with `edgetrain client --join %s`",
            authority.directory, authority.fingerprint[:16], token)
    return authority


def operator_identity(identity: Path | None, authority_dir: Path | None) -> Identity:
    """An operator's credential: `identity` (a bundle from `edgetrain operator add`) or, on the
    gateway, the authority's own operator certificate (TrustError with what to do when neither)."""
    if identity is not None:
        return Identity.load(identity)
    default = default_home() / "operator.pem"
    if default.exists():
        return Identity.load(default)
    directory = authority_dir or default_authority_dir()
    if (directory / "operator").exists():
        return Authority(directory).operator_identity()
    raise TrustError("no operator credential: on the gateway run `edgetrain init`; elsewhere ask the gateway "
                     f"for one (`edgetrain operator add NAME --out FILE`) and save it as {default} or pass --identity")
