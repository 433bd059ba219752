"""The one transport: every gRPC server, channel, credential, retry and bundle transfer goes here.

- Options: every channel and server option, each with the reason it is set.
- ``Security``: how servers and channels authenticate; the single place credentials plug in.
- ``create_server`` (returns the bound port), ``open_channel`` and ``ChannelCache``.
- ``abort`` / ``error_reason``: a refusal carries a typed reason (protos/errors.proto) in its
  trailing metadata, so peers act on the reason instead of matching status text.
- ``RetryPolicy``: exponential backoff with a time budget, retrying only the status codes it is
  given (calls: UNAVAILABLE; resumable transfers also a broken or truncated stream).
- ``receive_bundle`` / ``send_bundle``: the resumable chunked transfer loops shared by parameter
  downloads, update uploads and stage-state pulls — a broken transfer resumes from the last good
  byte, and a transfer that made progress starts its retry budget afresh.
- ``read_bundle``: the receiving side of a client stream (no resume: the sender resumes).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import grpc

from edgetrain import serde
from edgetrain.streaming import ChunkAssembler, TensorMeta, TransferError
from protos import errors_pb2 as epb

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""Receive/send limit. Tensors travel in <= 1 MiB chunks; 8 MiB leaves headroom for headers."""

KEEPALIVE_TIME_MS = 20_000
"""Client pings every 20 s so a slow board's idle channel is not silently dropped by NATs."""

DEFAULT_CHUNK_BYTES = 512 * 1024
"""Chunk size for tensor streams: 256 KiB - 1 MiB streams reached ~1 GiB/s on loopback."""

SERVER_OPTIONS: list[tuple[str, int]] = [
    # Chunked streams keep every message small; the limit rejects oversize ones precisely.
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Accept the clients' 20 s keepalive pings instead of answering GOAWAY too_many_pings.
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # Without this a second coordinator silently binds the same port.
    ("grpc.so_reuseport", 0),
    # Ping quiet peers every 5 s and cut those that do not answer within 5 s (a LAN answers in
    # milliseconds; the client's C core answers even while its Python is busy or in a GC pause):
    # a board that lost power or its link ends its presence stream, and is lost, within ~10 s.
    ("grpc.keepalive_time_ms", 5_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Keepalive is off on clients by default; slow boards on idle links were being cut off.
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # A restarted coordinator should be retried quickly, not after the default 20 s+ backoff.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]

ERROR_METADATA_KEY = "edgetrain-error-bin"
"""Trailing-metadata key of a refusal's serialized ErrorDetail (binary: the -bin suffix)."""


# --- servers and channels -------------------------------------------------------------------------

@dataclass(frozen=True)
class Security:
    """How servers and channels authenticate: the one place credentials plug in.

    Every server and channel of EdgeTrain is made from a Security. This one is plaintext and
    unauthenticated; callers that build it on purpose say so (see ``INSECURE``)."""

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """Credentials a server listens with (None: plaintext)."""
        return None

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Credentials a channel dials with (None: plaintext)."""
        return None

    def channel_options(self) -> list[tuple[str, Any]]:
        """Extra channel options (the name the server must prove)."""
        return []

    @property
    def generation(self) -> int:
        """Changes when the credentials were renewed: channels made before are reopened."""
        return 0

    @property
    def secure(self) -> bool:
        return False


INSECURE = Security()
"""Plaintext, unauthenticated transport: only for `--insecure` runs and loopback baselines."""


class Credentials:
    """A member's current identity (key, certificate, CA), replaced in place when it renews."""

    def __init__(self, identity) -> None:
        self._lock = threading.Lock()
        self._identity = identity
        self.generation = 0

    @property
    def identity(self):
        with self._lock:
            return self._identity

    def replace(self, identity) -> None:
        """Use `identity` from now on (new channels and new handshakes of servers)."""
        with self._lock:
            self._identity = identity
            self.generation += 1


@dataclass(frozen=True)
class MutualTLS(Security):
    """Mutual TLS inside the fleet: both sides show a certificate signed by the fleet CA.

    A server made with it verifies client certificates against the CA; with
    `require_client_auth` False it also lets callers without one finish the handshake (the
    pairing call needs that), and ``Guard`` then refuses every other call of theirs. A channel
    verifies that the server holds a fleet certificate for `server_name`."""

    credentials: Any  # Credentials or an edgetrain.trust.Identity
    server_name: str = "gateway.edgetrain"
    require_client_auth: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.credentials, Credentials):
            object.__setattr__(self, "credentials", Credentials(self.credentials))

    def server_credentials(self) -> grpc.ServerCredentials:
        seen = [self.credentials.generation]

        def config(identity):
            return grpc.ssl_server_certificate_configuration([(identity.key, identity.cert + identity.ca)],
                                                             root_certificates=identity.ca)

        def fetch():  # called at each handshake: a renewed certificate is served from then on
            if self.credentials.generation == seen[0]:
                return None
            seen[0] = self.credentials.generation
            return config(self.credentials.identity)

        return grpc.dynamic_ssl_server_credentials(config(self.credentials.identity), fetch,
                                                   require_client_authentication=self.require_client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        identity = self.credentials.identity
        return grpc.ssl_channel_credentials(root_certificates=identity.ca, private_key=identity.key,
                                            certificate_chain=identity.cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)]

    @property
    def generation(self) -> int:
        return self.credentials.generation

    @property
    def secure(self) -> bool:
        return True

    def dialing(self, server_name: str) -> MutualTLS:
        """The same credentials, dialing servers that must prove `server_name`."""
        return MutualTLS(self.credentials, server_name=server_name, require_client_auth=self.require_client_auth)


# --- who is calling -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Peer:
    """The fleet member on the other end of a call, from its verified certificate."""

    name: str
    role: str
    serial: int


_PEERS: dict[bytes, Peer | None] = {}
_PEERS_LOCK = threading.Lock()


def authenticated_channel(context: grpc.ServicerContext) -> bool:
    """Whether the call came over TLS, whose records are authenticated byte for byte (a payload
    sent over it needs no checksum of its own)."""
    return (context.auth_context() or {}).get("transport_security_type") == [b"ssl"]


def peer_of(context: grpc.ServicerContext) -> Peer | None:
    """The verified fleet member calling (None: no certificate, or a plaintext server)."""
    pems = (context.auth_context() or {}).get("x509_pem_cert")
    if not pems:
        return None
    pem = pems[0]
    with _PEERS_LOCK:
        if pem in _PEERS:
            return _PEERS[pem]
    from cryptography import x509  # imported on the first secure call only

    from edgetrain.trust import holder_of

    try:
        holder = holder_of(x509.load_pem_x509_certificate(pem))
        peer: Peer | None = Peer(holder.name, holder.role, holder.serial)
    except ValueError:
        peer = None
    with _PEERS_LOCK:
        if len(_PEERS) > 4096:
            _PEERS.clear()
        _PEERS[pem] = peer
    return peer


OPEN = frozenset({"*"})
"""Access rule of a method anyone may call (still over TLS): pairing."""


class Guard(grpc.ServerInterceptor):
    """Refuses, before the handler runs, a call without a fleet certificate (UNAUTHENTICATED), with
    a revoked one or from a role the method does not admit (PERMISSION_DENIED).

    `access` maps "Service/Method" (e.g. "Coordinator/Register") to the roles that may call it
    (``OPEN``: anyone); a method not in it admits every fleet role. `revoked(serial)` says whether a certificate was revoked."""

    def __init__(self, access: dict[str, frozenset[str]], revoked: Callable[[int], bool] = lambda serial: False,
                 default: frozenset[str] = frozenset({"gateway", "board", "operator"})) -> None:
        self.access = access
        self.revoked = revoked
        self.default = default

    def check(self, method: str, context: grpc.ServicerContext) -> Peer | None:
        roles = self.access.get(method, self.default)
        if roles is OPEN:
            return None
        peer = peer_of(context)
        if peer is None:
            abort(context, grpc.StatusCode.UNAUTHENTICATED,
                  f"{method} needs a fleet certificate (pair this machine with a join token first)",
                  epb.NOT_AUTHENTICATED)
        if self.revoked(peer.serial):
            abort(context, grpc.StatusCode.PERMISSION_DENIED,
                  f"the certificate of {peer.role} {peer.name} was revoked; it needs a new join token",
                  epb.CREDENTIAL_REVOKED)
        if peer.role not in roles:
            abort(context, grpc.StatusCode.PERMISSION_DENIED,
                  f"{method} is not for a {peer.role} ({peer.name}); it needs a {' or '.join(sorted(roles))} "
                  "credential", epb.NOT_PERMITTED)
        return peer

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        service, _, name = handler_call_details.method.lstrip("/").partition("/")
        method = f"{service.rsplit('.', 1)[-1]}/{name}"  # "/edgetrain.v1.Coordinator/Register" -> "Coordinator/Register"
        for kind, make in (("unary_unary", grpc.unary_unary_rpc_method_handler),
                           ("unary_stream", grpc.unary_stream_rpc_method_handler),
                           ("stream_unary", grpc.stream_unary_rpc_method_handler),
                           ("stream_stream", grpc.stream_stream_rpc_method_handler)):
            behaviour = getattr(handler, kind)
            if behaviour is not None:
                return make(self._guarded(method, behaviour), request_deserializer=handler.request_deserializer,
                            response_serializer=handler.response_serializer)
        return handler

    def _guarded(self, method: str, behaviour):
        def run(request, context):
            self.check(method, context)
            return behaviour(request, context)
        return run


def require_peer(context: grpc.ServicerContext, name: str, what: str) -> None:
    """PERMISSION_DENIED unless the caller is fleet member `name` (nothing to check on a plaintext
    server, where the operator chose --insecure)."""
    peer = peer_of(context)
    if peer is not None and peer.name != name:
        abort(context, grpc.StatusCode.PERMISSION_DENIED,
              f"{peer.role} {peer.name} cannot {what} of {name}", epb.NOT_PERMITTED)


def create_server(address: str, services: Sequence[tuple[Callable[[Any, grpc.Server], None], Any]], *,
                  max_workers: int = 64, security: Security = INSECURE,
                  guard: Guard | None = None) -> tuple[grpc.Server, int]:
    """A started gRPC server for `services` ((add_XServicer_to_server, servicer) pairs) bound to
    `address` ("host:0" picks a free port); returns it with the bound port. With a secure
    `security`, every call passes `guard` (default: any fleet certificate, none revoked)."""
    if security.secure and guard is None:
        guard = Guard({})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=SERVER_OPTIONS,
                         interceptors=[guard] if security.secure and guard else None)
    for add, servicer in services:
        add(servicer, server)
    credentials = security.server_credentials()
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as e:  # grpcio raises when the address cannot be bound
        raise OSError(f"cannot bind {address}: {e}") from None
    if port == 0:
        raise OSError(f"cannot bind {address}")
    server.start()
    return server, port


def open_channel(address: str, security: Security = INSECURE) -> grpc.Channel:
    """A channel to `address` with EdgeTrain's options."""
    credentials = security.channel_credentials()
    if credentials is not None:
        return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS + security.channel_options())
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


class ChannelCache:
    """One channel per peer address, shared by every call to it (thread-safe)."""

    def __init__(self, security: Security = INSECURE) -> None:
        self.security = security
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._generation = security.generation

    def get(self, address: str) -> grpc.Channel:
        """The channel to `address`, opened on first use (and again after the credentials renewed)."""
        with self._lock:
            if self._generation != self.security.generation:
                for channel in self._channels.values():
                    channel.close()
                self._channels.clear()
                self._generation = self.security.generation
            if address not in self._channels:
                self._channels[address] = open_channel(address, self.security)
            return self._channels[address]

    def close(self) -> None:
        """Close every channel."""
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


# --- typed refusals -------------------------------------------------------------------------------

def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str,
          reason: int = epb.ERROR_REASON_UNSPECIFIED) -> NoReturn:
    """End the call with `code` and `message`, and `reason` (an ErrorReason) for the peer to act on."""
    if reason:
        context.set_trailing_metadata(((ERROR_METADATA_KEY, epb.ErrorDetail(reason=reason).SerializeToString()),))
    context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")  # for type checkers


def error_reason(error: grpc.RpcError) -> int:
    """The ErrorReason a refused call carried (ERROR_REASON_UNSPECIFIED when it carried none)."""
    metadata = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in metadata or ():
        if key == ERROR_METADATA_KEY:
            try:
                return epb.ErrorDetail.FromString(value).reason
            except Exception:  # a malformed detail is no reason at all  # noqa: BLE001
                return epb.ERROR_REASON_UNSPECIFIED
    return epb.ERROR_REASON_UNSPECIFIED


def describe(error: BaseException) -> str:
    """One line for a failed call or transfer: the status name and its message."""
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}"
    return str(error)


# --- retries --------------------------------------------------------------------------------------

class Unreachable(ConnectionError):
    """The peer stayed unavailable (or the transfer kept breaking) for the whole retry budget."""


CALL_RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
"""A call is retried only when the peer could not be reached: any other status is an answer."""
TRANSFER_RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
                                  grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED})
"""A resumable transfer also resumes after a broken, truncated or timed-out stream."""


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff (with jitter) on the retryable status codes, within a time budget."""

    budget_s: float | None = 60.0
    """How long to keep retrying; None: indefinitely."""
    max_tries: int | None = None
    """At most this many tries, however quick (None: as many as the budget allows)."""
    initial_s: float = 0.2
    """First delay."""
    max_s: float = 5.0
    """Longest delay between two tries."""
    retry_on: frozenset[grpc.StatusCode] = CALL_RETRY_CODES
    """Status codes worth another try."""
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False, repr=False)

    def retryable(self, error: BaseException) -> bool:
        """Whether `error` is worth another try under this policy."""
        if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
            return error.code() in self.retry_on
        if isinstance(error, TransferError):  # a broken stream seen on this side: resume it
            return grpc.StatusCode.DATA_LOSS in self.retry_on and error.kind in ("data_loss", "out_of_range")
        return False

    def start(self, what: str) -> Backoff:
        """A fresh backoff for one operation named `what` (for logs and the Unreachable message)."""
        return Backoff(self, what)

    def call(self, fn: Callable[[], T], what: str) -> T:
        """`fn()`, retried on retryable errors until the budget is spent (then Unreachable)."""
        backoff = self.start(what)
        while True:
            try:
                return fn()
            except (grpc.RpcError, TransferError) as e:
                if not self.retryable(e):
                    raise
                backoff.wait(e)


class Backoff:
    """The waits of one operation under a RetryPolicy."""

    def __init__(self, policy: RetryPolicy, what: str) -> None:
        self.policy = policy
        self.what = what
        self.tries = 0
        self._rng = random.Random()
        self.reset()

    def reset(self) -> None:
        """The operation made progress: its budget and delays start afresh."""
        self._delay = self.policy.initial_s
        self._deadline = None if self.policy.budget_s is None else time.monotonic() + self.policy.budget_s

    def wait(self, error: BaseException) -> None:
        """Sleep before the next try, or raise Unreachable (from `error`) when the budget is spent."""
        self.tries += 1
        delay = self._delay * (0.5 + self._rng.random())  # jitter: boards that lost one server spread out
        if self.policy.max_tries is not None and self.tries >= self.policy.max_tries:
            raise Unreachable(f"{self.what}: gave up after {self.tries} tries ({describe(error)})") from error
        if self._deadline is not None and time.monotonic() + delay > self._deadline:
            raise Unreachable(f"{self.what}: gave up after {self.tries} tries in {self.policy.budget_s:g} s "
                              f"({describe(error)})") from error
        logger.debug("[Transport] %s failed (%s); retrying in %.1f s", self.what, describe(error), delay)
        self.policy.sleep(delay)
        self._delay = min(self._delay * 2, self.policy.max_s)


CALLS = RetryPolicy()
"""The default for calls: retry UNAVAILABLE for up to a minute."""
TRANSFERS = RetryPolicy(budget_s=30.0, retry_on=TRANSFER_RETRY_CODES)
"""The default for transfers: resume a broken stream; 30 s without progress ends it."""


# --- resumable bundle transfers -------------------------------------------------------------------

def receive_bundle(open_stream: Callable[[int], Iterable[Any]], what: str, *, retry: RetryPolicy = TRANSFERS,
                   on_chunk: Callable[[Any], None] | None = None,
                   on_progress: Callable[[list[TensorMeta], bytearray, int], None] | None = None,
                   ) -> tuple[list[TensorMeta], bytearray]:
    """A bundle streamed as a ``header`` message then ``chunk`` messages (any message with those
    fields in its ``kind`` oneof), resuming from the last good byte after a retryable failure.

    `open_stream(offset)` opens the stream at byte `offset` (the header always comes first);
    `on_chunk(chunk)` sees each chunk before it is added (a link emulator may raise
    TransferError(data_loss) there to drop it); `on_progress(metas, payload, received)` is told
    after the header and after each chunk that the first `received` bytes of `payload` (the
    buffer the bundle is assembled in, which stays the same across resumed streams) are final."""
    assembler: ChunkAssembler | None = None
    metas: list[TensorMeta] = []
    backoff, progress = retry.start(what), 0
    while True:
        offset = assembler.received if assembler else 0
        if offset > progress:
            backoff.reset()
            progress = offset
        try:
            for message in open_stream(offset):
                kind = message.WhichOneof("kind")
                if kind == "header":
                    metas, total = serde.header_from_proto(message.header)
                    if assembler is not None and assembler.total_bytes != total:
                        raise TransferError("invalid_argument", f"{what}: the resumed stream declares {total} "
                                            f"bytes, the first one {assembler.total_bytes}")
                    assembler = assembler or ChunkAssembler(total)
                elif kind == "chunk" and assembler is not None:
                    if on_chunk is not None:
                        on_chunk(message.chunk)
                    assembler.add(message.chunk.offset, message.chunk.data, serde.chunk_crc32(message.chunk))
                else:
                    raise TransferError("invalid_argument", f"{what}: a {kind} message where the stream's "
                                        f"{'chunks' if assembler else 'header'} should be")
                if on_progress is not None:
                    on_progress(metas, assembler.buffer, assembler.received)
            if assembler is None:
                raise TransferError("data_loss", f"{what}: the stream ended before its header")
            return metas, assembler.payload()
        except (grpc.RpcError, TransferError) as e:
            if not retry.retryable(e):
                raise
            logger.info("[Transport] %s interrupted at byte %d (%s); resuming", what,
                        assembler.received if assembler else 0, describe(e))
            backoff.wait(e)


def send_bundle(send_from: Callable[[int], None], held: Callable[[], int], what: str, *,
                retry: RetryPolicy = TRANSFERS) -> None:
    """Send a bundle with `send_from(start)` (one call streaming bytes `start..`), resuming after a
    retryable failure from what the receiver holds (`held()`). ALREADY_EXISTS after a failed try
    means an earlier try was accepted and only its reply was lost: done."""
    start, backoff = 0, retry.start(what)
    while True:
        try:
            send_from(start)
            return
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.ALREADY_EXISTS and backoff.tries:
                return
            if not retry.retryable(e):
                raise
            logger.info("[Transport] %s interrupted (%s); resuming", what, describe(e))
            backoff.wait(e)
        try:
            resumed = held()
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.ALREADY_EXISTS:
                return  # the interrupted try was accepted; only its reply was lost
            raise
        if resumed > start:
            backoff.reset()
        start = resumed


def read_bundle(messages: Iterator[Any], total: int, *, after: str,
                on_chunk: Callable[[int], None] | None = None) -> bytearray:
    """The payload of a bundle whose ``chunk`` messages follow in `messages` (the receiving side
    of a client stream); TransferError on anything else, a bad checksum, a gap or a short stream.
    `on_chunk` is told each chunk's size (a link emulator's receive side)."""
    assembler = ChunkAssembler(total)
    for message in messages:
        if message.WhichOneof("kind") != "chunk":
            raise TransferError("invalid_argument", f"only chunks may follow the {after}")
        if on_chunk is not None:
            on_chunk(len(message.chunk.data))
        assembler.add(message.chunk.offset, message.chunk.data, serde.chunk_crc32(message.chunk))
    return assembler.payload()
