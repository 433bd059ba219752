"""This board's fleet credentials: found or paired at start, used by every channel and server of
the board, renewed in the background, and checked before each call.

- ``obtain``: the identity kept for this board (``--identity``, or ~/.edgetrain/boards/NAME), or
  a new one paired with the join token; one line (a TrustError) when the board cannot go on: not
  paired and no token, its certificate expired or made out to another name.
- ``BoardCredentials``: one ``transport.Credentials`` shared by the connection to the gateway,
  the lobby and the StagePeer endpoint, so a renewed certificate is used everywhere (channels
  reopen on the new generation). ``calls()`` wraps a call: it checks the certificate locally
  first (an expired one would only fail handshakes, again and again) and turns the gateway's
  CREDENTIAL_REVOKED refusal into ``CredentialRevoked``, which ends the client in one line.
- Renewal: a daemon thread asks the gateway for a new certificate once less than a third of the
  current one's lifetime is left, checking at start and then every lifetime/20 (5 s to 1 h).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
from cryptography import x509

from edge_client.pairing import CertificateExpired, CredentialRevoked, pair, pairing_address, renew
from edgetrain import transport, trust
from edgetrain.errors import Refusal

logger = logging.getLogger(__name__)
T = TypeVar("T")

RENEW_CHECKS_S = (5.0, 3600.0)
"""Bounds of the interval between two renewal checks (lifetime / 20 within them)."""
PAIR_RETRY = transport.RetryPolicy(budget_s=60.0, max_s=5.0)
"""A gateway not answering yet (it may be starting) is asked again this long."""


def not_paired_message() -> str:
    return ("this board is not paired: run `edgetrain client --join TOKEN` "
            "(make a token with `edgetrain token new` on the gateway)")


def expired_message(holder: trust.Holder) -> str:
    return (f"certificate of {holder.name} expired on {holder.not_after:%Y-%m-%d %H:%M} UTC: pair again with a new "
            "token (`edgetrain client --join TOKEN`)")


def revoked_message(name: str) -> str:
    return f"{name}'s certificate was revoked by the gateway: it needs a new join token"


class BoardCredentials:
    """The board's current identity (`credentials`, replaced in place on renewal), where it is
    kept (`path`), and its renewal."""

    def __init__(self, identity: trust.Identity, path: Path, *, pair_started: float | None = None,
                 check_every_s: float | None = None) -> None:
        self.credentials = transport.Credentials(identity)
        self.path = Path(path)
        self.name = identity.holder.name
        self.pair_started = pair_started
        """time.perf_counter() when this run started to pair (None: the identity was kept)."""
        self.gateway_address: str | None = None
        """The gateway the board talks to (fleet port): renewals are asked there."""
        self._check_every_s = check_every_s
        self._holder = (-1, identity.holder)
        self._revoked: CredentialRevoked | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def identity(self) -> trust.Identity:
        return self.credentials.identity

    @property
    def ca_fingerprint(self) -> str:
        return self.identity.ca_fingerprint

    def gateway(self) -> transport.MutualTLS:
        """How to dial the gateway (coordinator, job server) with this identity."""
        return transport.MutualTLS(self.credentials, server_name=trust.GATEWAY_SERVER_NAME)

    # --- checks ---------------------------------------------------------------------------
    def holder(self) -> trust.Holder:
        """Who the current certificate names (parsed once per generation)."""
        generation, holder = self._holder
        if generation != self.credentials.generation:
            generation = self.credentials.generation
            holder = self.credentials.identity.holder
            self._holder = (generation, holder)
        return holder

    def check(self) -> None:
        """CredentialRevoked when the gateway refused a renewal as revoked, CertificateExpired
        when the certificate has expired: connecting again would only fail its handshakes."""
        if self._revoked is not None:
            raise self._revoked
        holder = self.holder()
        if dt.datetime.now(dt.timezone.utc) >= holder.not_after:
            raise CertificateExpired(expired_message(holder))

    def revoked(self, error: BaseException) -> CredentialRevoked | None:
        """The refusal `error` as CredentialRevoked when the gateway refused this certificate as
        revoked (None for any other error)."""
        if isinstance(error, grpc.RpcError) and transport.error_reason(error) == Refusal.CREDENTIAL_REVOKED:
            return CredentialRevoked(revoked_message(self.name))
        return None

    @contextlib.contextmanager
    def calls(self) -> Iterator[None]:
        """Around calls to the gateway: check the certificate first; a refusal as revoked ends
        the client (CredentialRevoked) instead of being retried or logged as a failed step."""
        self.check()
        try:
            yield
        except grpc.RpcError as e:
            revoked = self.revoked(e)
            if revoked is not None:
                raise revoked from None
            raise

    def checked(self, call: Callable[[], T]) -> Callable[[], T]:
        """`call`, checking the certificate before each try (for retry loops)."""
        def run() -> T:
            self.check()
            return call()
        return run

    # --- renewal --------------------------------------------------------------------------
    def check_interval_s(self) -> float:
        """Seconds between two renewal checks: a twentieth of the certificate's lifetime, 5 s to 1 h."""
        if self._check_every_s is not None:
            return self._check_every_s
        cert = x509.load_pem_x509_certificate(self.identity.cert)
        lifetime = (cert.not_valid_after_utc - cert.not_valid_before_utc).total_seconds()
        return min(max(lifetime / 20, RENEW_CHECKS_S[0]), RENEW_CHECKS_S[1])

    def start_renewal(self) -> None:
        """Renew in the background from now on (once; renewals go to `gateway_address`)."""
        if self._renewer is None:
            self._renewer = threading.Thread(target=self._renew_loop, name="renewal", daemon=True)
            self._renewer.start()

    def stop(self) -> None:
        """Stop renewing."""
        self._stop.set()

    def renew_if_due(self) -> bool:
        """Renew now if less than a third of the lifetime is left; whether it renewed. A refusal
        as revoked is kept for `check()` to raise; other failures are logged (tried again later)."""
        identity = self.identity
        if not identity.needs_renewal() or not self.gateway_address:
            return False
        try:
            renew(self.gateway_address, self.credentials, self.path)
            return True
        except CredentialRevoked:
            self._revoked = CredentialRevoked(revoked_message(self.name))
            logger.error("[Client] %s", self._revoked)
        except (grpc.RpcError, transport.Unreachable, trust.TrustError, OSError) as e:
            logger.warning("[Client] renewing the certificate of %s (valid until %s) failed: %s; trying again in "
                           "%.0f s", self.name, identity.holder.not_after.isoformat(timespec="seconds"),
                           transport.describe(e), self.check_interval_s())
        return False

    def _renew_loop(self) -> None:
        while not self._stop.is_set() and self._revoked is None:
            self.renew_if_due()
            if self._stop.wait(self.check_interval_s()):
                return


def _unusable(identity: trust.Identity, name: str, path: Path) -> str | None:
    """Why the identity kept at `path` cannot serve board `name` (None: it can)."""
    holder = identity.holder
    if holder.role != trust.BOARD:
        return f"the certificate at {path} is a {holder.role}'s, not a board's"
    if holder.name != name:
        return (f"the certificate at {path} is {holder.name}'s, not {name}'s: run the client with --name "
                f"{holder.name}, or pair {name} with a new token (`edgetrain client --join TOKEN`)")
    if identity.expired():
        return expired_message(holder)
    return None


def obtain(name: str, *, identity_path: Path | None, join_token: str | None, address: str | None,
           pair_address: str | None, find_gateway: Callable[[str], str]) -> BoardCredentials:
    """Board `name`'s credentials: the identity kept at `identity_path` (default
    ~/.edgetrain/boards/NAME), or, when there is none or it cannot serve (expired, another name,
    another fleet than the token's), a new one paired with `join_token`. The gateway to pair with
    is `address` or the one `find_gateway(ca_fingerprint)` finds; its pairing port is
    `pair_address` or the next port. TrustError (one line) when the board cannot go on."""
    path = Path(identity_path) if identity_path else trust.default_identity_path(name)
    token = trust.JoinToken.parse(join_token) if join_token else None
    if trust.Identity.exists(path):
        identity = trust.Identity.load(path)
        problem = _unusable(identity, name, path)
        if problem is None and (token is None or token.ca_fingerprint == identity.ca_fingerprint):
            return BoardCredentials(identity, path)
        if token is None:
            raise trust.TrustError(problem)
        logger.warning("[Client] %s; pairing again with the join token given", problem or
                       f"the join token is for another fleet than the certificate at {path}")
    elif token is None:
        raise trust.TrustError(not_paired_message())
    started = time.perf_counter()
    where = pair_address or pairing_address(address or find_gateway(token.ca_fingerprint))
    backoff = PAIR_RETRY.start(f"pairing with the gateway at {where}")
    while True:
        try:
            identity = pair(where, token, name, path)
            break
        except transport.Unreachable as e:
            backoff.wait(e)
    logger.info("[Client] %s paired in %.2f s (certificate valid until %s)", name, time.perf_counter() - started,
                identity.holder.not_after.isoformat(timespec="minutes"))
    return BoardCredentials(identity, path, pair_started=started)


def trusted_calls(credentials: BoardCredentials | None):
    """Around calls to the gateway: `credentials.calls()`, or nothing on a plaintext (--insecure)
    connection."""
    return credentials.calls() if credentials is not None else contextlib.nullcontext()
