"""Announce the coordinator on the LAN over mDNS/DNS-SD so boards can find it without an address.

The advertisement is static metadata only (cluster, protocol version, whether a token is
needed); anything live travels over gRPC. Zeroconf is always pinned to explicit interfaces.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from dataclasses import dataclass
from types import TracebackType

from zeroconf import IPVersion, ServiceInfo, Zeroconf

from edgetrain import PROTOCOL_VERSION, SERVICE_TYPE

logger = logging.getLogger(__name__)

_MAX_LABEL_BYTES = 63
_MAX_TXT_VALUE_BYTES = 254


def sanitise_label(text: str) -> str:
    """Reduce ``text`` to a DNS label: letters, digits and single hyphens, at most 63 bytes."""
    label = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:_MAX_LABEL_BYTES].rstrip("-")
    return label or "edgetrain"


@dataclass(kw_only=True, frozen=True)
class Advertisement:
    """What the coordinator announces about itself."""

    cluster: str
    """Cluster name; boards started with ``--cluster NAME`` join only this coordinator."""
    host: str
    """IPv4 address boards should dial, e.g. "127.0.0.1" or a bridge address."""
    port: int
    """The coordinator's gRPC port."""
    protocol_version: int
    """Wire protocol version; boards skip coordinators that speak another one."""
    ca_fingerprint: str = ""
    """SHA-256 of the fleet CA certificate (hex) when the coordinator serves mutual TLS; empty for
    an `--insecure` coordinator. Boards pick the fleet whose CA their token or certificate names.
    The join token itself is never advertised."""
    instance: str | None = None
    """DNS-SD instance name; defaults to "<cluster>-<hostname>-<port>" reduced to a DNS label."""

    def __post_init__(self) -> None:
        if not self.cluster:
            raise ValueError("cluster must not be empty")
        if len(self.cluster.encode()) > _MAX_TXT_VALUE_BYTES:
            raise ValueError(f"cluster must be < 255 bytes, got {len(self.cluster.encode())}")
        try:
            ipaddress.IPv4Address(self.host)
        except ValueError as e:
            raise ValueError(f"host must be an IPv4 address, got {self.host!r}") from e
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.protocol_version < 0:
            raise ValueError(f"protocol_version must be >= 0, got {self.protocol_version}")
        if self.instance is None:
            default = sanitise_label(f"{self.cluster}-{socket.gethostname()}-{self.port}")
            object.__setattr__(self, "instance", default)
        elif not self.instance or len(self.instance.encode()) > _MAX_LABEL_BYTES:
            raise ValueError(f"instance must be 1..63 bytes, got {self.instance!r}")

    def txt(self) -> dict[str, str]:
        """The TXT record: protocol version, cluster, whether it serves TLS and its CA's fingerprint."""
        return {
            "proto": str(self.protocol_version),
            "cluster": self.cluster,
            "tls": "1" if self.ca_fingerprint else "0",
            "ca": self.ca_fingerprint,
        }


class DiscoveryAdvertiser:
    """Registers one ``Advertisement`` on the given interfaces until closed.

    ``start()`` returns once the name has been probed and announced (about 1-2 s); if another
    live service holds the instance name, zeroconf renames ours ("name-2") and ``instance``
    reports the name actually used. ``close()`` sends goodbye packets so browsers drop us at once.
    """

    def __init__(self, ad: Advertisement, *, interfaces: list[str]) -> None:
        if not interfaces:
            raise ValueError("interfaces must name at least one IPv4 address")
        self.ad = ad
        self.interfaces = list(interfaces)
        self._zc: Zeroconf | None = None
        self._info: ServiceInfo | None = None

    @property
    def instance(self) -> str:
        """The registered instance name (it differs from ``ad.instance`` after a rename)."""
        if self._info is not None:
            return self._info.name.removesuffix(f".{SERVICE_TYPE}")
        assert self.ad.instance is not None
        return self.ad.instance

    def start(self) -> None:
        """Register the service; returns once it is announced."""
        if self._zc is not None:
            raise RuntimeError("advertiser already started")
        assert self.ad.instance is not None
        info = ServiceInfo(
            SERVICE_TYPE,
            f"{self.ad.instance}.{SERVICE_TYPE}",
            port=self.ad.port,
            properties=self.ad.txt(),
            server=f"{sanitise_label(self.ad.instance)}.local.",
            parsed_addresses=[self.ad.host],
        )
        zc = Zeroconf(interfaces=self.interfaces, ip_version=IPVersion.V4Only)
        try:
            zc.register_service(info, allow_name_change=True)
        except BaseException:
            zc.close()
            raise
        self._zc, self._info = zc, info
        logger.info("[Coordinator.Discovery] advertising %s at %s:%d on %s", self.instance,
                    self.ad.host, self.ad.port, self.interfaces)

    def close(self) -> None:
        """Unregister (goodbye packets) and release the sockets; safe to call repeatedly."""
        zc, self._zc = self._zc, None
        if zc is None:
            return
        try:
            assert self._info is not None
            zc.unregister_service(self._info)
        finally:
            zc.close()
        logger.info("[Coordinator.Discovery] stopped advertising %s", self.instance)

    def __enter__(self) -> DiscoveryAdvertiser:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def advertise_on(cluster: str, host: str, port: int, interfaces: list[str], *,
                 ca_fingerprint: str = "") -> DiscoveryAdvertiser:
    """Announce the coordinator over mDNS; a wildcard bind advertises the first interface's address."""
    address = interfaces[0] if host in ("0.0.0.0", "", "[::]") else host
    advertiser = DiscoveryAdvertiser(Advertisement(cluster=cluster, host=address, port=port,
                                                   protocol_version=PROTOCOL_VERSION,
                                                   ca_fingerprint=ca_fingerprint),
                                     interfaces=interfaces)
    advertiser.start()
    return advertiser
