"""Find coordinators and job servers on the LAN over mDNS/DNS-SD instead of being told an address.

Every call opens a fresh Zeroconf on the given interfaces and closes it before returning, so
nothing is cached between calls: after a coordinator restarts, the next ``find_coordinator``
sees its new records, not stale ones. Callers re-run ``find_coordinator`` when a connection
fails.

Browsing stops at the deadline, or earlier once what the caller needs has been resolved and
no new coordinator has appeared for ``QUIET_S``. Questions are asked as QM (answer by
multicast): several mDNS stacks on one address (loopback, one host running many roles) all
bind port 5353 with SO_REUSEPORT, and a unicast answer to a QU question reaches only one of
them, often not the asker.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc
import psutil
from zeroconf import (
    DNSQuestionType,
    IPVersion,
    ServiceBrowser,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
)

from edgetrain import SERVICE_TYPE, transport
from protos import jobs_pb2 as jobs_pb
from protos import jobs_pb2_grpc as jobs_pb_grpc

logger = logging.getLogger(__name__)

QUIET_S = 1.2
"""Browsing may stop early once nothing new has appeared for this long. A responder answers
within 20-120 ms, but one that multicast the same record in the last second must wait a
second more (RFC 6762 section 14), e.g. just after it announced itself."""
RESOLVE_TIMEOUT_S = 1.5
"""Upper bound for resolving one announced instance to its address and TXT record."""

_Changes = queue.SimpleQueue[tuple[str, ServiceStateChange]]
"""Browser events (instance name, change), handed from zeroconf's thread to the caller's."""


class CoordinatorNotFound(LookupError):
    """No single coordinator matched within the time allowed; the message lists what was seen."""


@dataclass(frozen=True)
class CoordinatorRecord:
    """One resolved coordinator advertisement."""

    instance: str
    """DNS-SD instance name, unique on the LAN."""
    cluster: str
    """Cluster name the coordinator serves."""
    address: str
    """gRPC address to dial, "ip:port"."""
    protocol_version: int
    """Wire protocol version the coordinator speaks."""
    tls: bool = False
    """Whether the coordinator serves mutual TLS (False: an `--insecure` coordinator)."""
    ca_fingerprint: str = ""
    """SHA-256 (hex) of its fleet CA certificate; empty when it serves plaintext."""


def browse(*, interfaces: list[str], timeout_s: float = 3.0) -> list[CoordinatorRecord]:
    """All coordinators seen on ``interfaces`` within ``timeout_s``, sorted by instance name.

    Returns early once at least one is resolved and none new appeared for ``QUIET_S``.
    """
    return _browse(interfaces, timeout_s, enough=bool)


def find_coordinator(
    *,
    interfaces: list[str],
    cluster: str | None = None,
    timeout_s: float = 10.0,
    protocol_version: int | None = None,
    ca_fingerprint: str | None = None,
) -> CoordinatorRecord:
    """The coordinator of ``cluster`` (or the only cluster advertised), speaking ``protocol_version``.

    Among several instances of the chosen cluster the first by instance name wins. Raises
    ``CoordinatorNotFound`` when none matches, or when ``cluster`` is None and several
    clusters are advertised. With ``ca_fingerprint``, only coordinators of that fleet (its CA)
    count: a board looks for its own fleet, not any coordinator on the LAN.
    """

    def usable(record: CoordinatorRecord) -> bool:
        return (cluster is None or record.cluster == cluster) and (
            protocol_version is None or record.protocol_version == protocol_version
        ) and (ca_fingerprint is None or record.ca_fingerprint == ca_fingerprint)

    records = _browse(interfaces, timeout_s, enough=lambda seen: any(map(usable, seen)))
    candidates = [r for r in records if usable(r)]
    clusters = sorted({r.cluster for r in candidates})
    if len(clusters) == 1:
        return candidates[0]
    where = f"on {', '.join(interfaces)} within {timeout_s:g} s"
    if clusters:
        raise CoordinatorNotFound(
            f"several clusters are advertised {where}: {clusters}; pass --cluster to pick one"
        )
    wanted = "any cluster" if cluster is None else f"cluster {cluster!r}"
    if protocol_version is not None:
        wanted += f" speaking protocol {protocol_version}"
    if ca_fingerprint is not None:
        wanted += f" of the fleet whose CA is {ca_fingerprint[:16]}…"
    seen = ", ".join(_describe(r, protocol_version) for r in records)
    raise CoordinatorNotFound(f"no coordinator for {wanted} {where}; saw: [{seen}]")


def default_interfaces() -> list[str]:
    """IPv4 addresses of the non-loopback interfaces that are up, else ["127.0.0.1"]."""
    stats = psutil.net_if_stats()
    found = [
        addr.address
        for name, addrs in psutil.net_if_addrs().items()
        if name in stats and stats[name].isup
        for addr in addrs
        if addr.family == socket.AF_INET and not ipaddress.IPv4Address(addr.address).is_loopback
    ]
    return sorted(set(found)) or ["127.0.0.1"]


def _describe(record: CoordinatorRecord, protocol_version: int | None) -> str:
    text = f"{record.cluster!r} at {record.address}"
    if protocol_version is not None and record.protocol_version != protocol_version:
        text += f" (protocol {record.protocol_version}, skipped)"
    return text


def _browse(
    interfaces: list[str],
    timeout_s: float,
    *,
    enough: Callable[[list[CoordinatorRecord]], bool],
) -> list[CoordinatorRecord]:
    """Browse until ``enough(records)`` holds and the network went quiet, or until the deadline."""
    if not interfaces:
        raise ValueError("interfaces must name at least one IPv4 address")
    deadline = time.monotonic() + timeout_s
    changes: _Changes = queue.SimpleQueue()

    def on_change(*, name: str, state_change: ServiceStateChange, **_: object) -> None:
        changes.put((name, state_change))

    zc = Zeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)
    try:
        browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[on_change],
                                 question_type=DNSQuestionType.QM)
        try:
            return _collect(zc, changes, deadline, enough)
        finally:
            browser.cancel()
    finally:
        zc.close()


def _collect(
    zc: Zeroconf,
    changes: _Changes,
    deadline: float,
    enough: Callable[[list[CoordinatorRecord]], bool],
) -> list[CoordinatorRecord]:
    """Apply browser events and resolve new names until done or the deadline."""
    records: dict[str, CoordinatorRecord] = {}
    pending: set[str] = set()
    last_new = time.monotonic()
    while (now := time.monotonic()) < deadline:
        try:
            name, change = changes.get(timeout=min(0.05, deadline - now))
        except queue.Empty:
            pass
        else:
            if change is ServiceStateChange.Removed:
                records.pop(name, None)
                pending.discard(name)
            else:
                last_new = time.monotonic() if name not in records else last_new
                pending.add(name)
            continue
        for name in sorted(pending):
            if (info := _resolve(zc, name, deadline)) is None:
                continue
            pending.discard(name)
            if (record := _record_from_info(info)) is not None:
                records[name] = record
        seen = list(records.values())
        if seen and not pending and enough(seen) and time.monotonic() - last_new >= QUIET_S:
            break
    return sorted(records.values(), key=lambda r: r.instance)


def _resolve(zc: Zeroconf, name: str, deadline: float) -> ServiceInfo | None:
    """Resolve one instance; None if it did not answer in time (the caller retries)."""
    timeout_s = min(RESOLVE_TIMEOUT_S, deadline - time.monotonic())
    if timeout_s <= 0:
        return None
    info = zc.get_service_info(SERVICE_TYPE, name, timeout=int(timeout_s * 1000),
                              question_type=DNSQuestionType.QM)
    if info is None:
        logger.debug("[Client.Discovery] %s did not resolve within %.1f s", name, timeout_s)
        return None
    return info


def _record_from_info(info: ServiceInfo) -> CoordinatorRecord | None:
    """The record an advertisement describes, or None if it is not one of ours."""
    addresses = info.parsed_addresses(IPVersion.V4Only)
    txt = {k.decode(errors="replace"): (v or b"").decode(errors="replace") for k, v in info.properties.items()}
    try:
        protocol_version = int(txt["proto"])
        cluster = txt["cluster"]
        tls = txt.get("tls") == "1"
        ca_fingerprint = txt.get("ca", "") if tls else ""
    except (KeyError, ValueError):
        logger.debug("[Client.Discovery] %s has a malformed TXT record %s", info.name, txt)
        return None
    if not addresses or info.port is None:
        logger.debug("[Client.Discovery] %s has no IPv4 address or port", info.name)
        return None
    return CoordinatorRecord(
        instance=info.name.removesuffix(f".{SERVICE_TYPE}"),
        cluster=cluster,
        address=f"{addresses[0]}:{info.port}",
        protocol_version=protocol_version,
        tls=tls,
        ca_fingerprint=ca_fingerprint,
    )


def serves_jobs(address: str, *, retry: transport.RetryPolicy = transport.CALLS,
                security: transport.Security = transport.INSECURE) -> bool:
    """Whether `address` serves the JobServer service (else a lone job's coordinator answers there);
    transport.Unreachable when nothing answers within `retry`'s budget."""
    channel = transport.open_channel(address, security)
    try:
        stub = jobs_pb_grpc.JobServerStub(channel)
        retry = replace(retry, retry_on=retry.retry_on | {grpc.StatusCode.DEADLINE_EXCEEDED})
        timeout = min(5.0, retry.budget_s or 5.0)
        retry.call(lambda: stub.Probe(jobs_pb.LobbyProbe(), timeout=timeout, wait_for_ready=True),
                   f"probe of {address}")
        return True
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            return False
        raise
    finally:
        channel.close()
