"""Every gRPC channel and server option EdgeTrain uses, each with the reason it is set."""

from __future__ import annotations

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
    # Ping idle peers too, so a board that lost power mid-upload frees its stream and thread.
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", 10_000),
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
