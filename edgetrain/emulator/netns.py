"""A virtual LAN of network namespaces, so emulated boards talk over rate-limited links (root only).

One Linux bridge ``{name}-br`` in the root namespace carries ``{prefix}.1/24``: the gateway,
where the coordinator listens. Each board gets a namespace joined to the bridge by a veth pair,
and ``tc tbf`` on both ends of the pair limits its rate in each direction. Delay and loss are
not done here (netem is absent from the target kernel): see :mod:`edgetrain.emulator.shaping`.

:meth:`VirtualLan.resources` records every name created, so :func:`destroy_resources` can tear
a LAN down from that record alone after the process that built it is gone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import uuid
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAX_LAN_NAME = 10
"""Longest LAN name: Linux interface names are at most 15 characters, and the veth names
``{name}-r{index}`` / ``{name}-n{index}`` must fit for index up to 253."""

MAX_NAMESPACE_NAME = 64
"""Namespace names are files under /run/netns; keep them readable in ``ip netns list``."""

_LAN_NAME = re.compile(r"^[a-z][a-z0-9]*$")
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_PREFIX = re.compile(rf"^{_OCTET}\.{_OCTET}\.{_OCTET}$")

_FRAME_BYTES = 1_514
"""An Ethernet frame at MTU 1500; tbf counts these bytes, so TCP goodput is ~1448/1514 = 0.956
of the configured rate."""

_TBF_BURST_S = 0.004
"""Bucket depth in seconds at the link rate (1/HZ at HZ=250). Measured with 2 s transfers:
at 1000 Mbit/s a 16 KiB bucket reached only 0.8 of the rate, 500 KB reached 0.96 (uplink)."""

_TBF_MIN_BURST_BYTES = 4 * _FRAME_BYTES
"""Bucket floor for slow links: a deeper one lets short transfers through too fast (64 KiB is
half a second at 1 Mbit/s); GSO packets bigger than the bucket are segmented by tbf."""

_TBF_LATENCY_S = 0.1
"""Queue a tbf holds beyond its bucket, in seconds at the link rate. The kernel has no AQM
(no fq_codel), so TCP fills this tail-drop queue until it loses a burst; with shallower queues
some 2 s transfers stalled on a retransmit timeout and reached only 0.8 of the rate."""

_TBF_MIN_QUEUE_BYTES = 256 * 1024
"""Queue floor for slow links: 50-200 ms queues up to 128 KiB still stalled now and then at
2-10 Mbit/s; 256 KiB never did. The price is up to ~2 s of queueing at 1 Mbit/s under load,
as on a bloated real uplink."""


class NetnsError(RuntimeError):
    """A command that builds or changes the virtual LAN failed."""


@dataclass(frozen=True)
class HostNetwork:
    """One board's place on the LAN: the namespace it runs in, its IP and both veth ends."""

    namespace: str
    ip: str
    veth_root: str
    """Root-namespace end, attached to the bridge; its egress is traffic to the board."""
    veth_ns: str
    """End inside the namespace; its egress is traffic from the board."""


@dataclass(frozen=True)
class TbfParams:
    """A tbf setting for one direction of a link."""

    rate_bit: int
    burst_bytes: int
    limit_bytes: int

    def tc_args(self) -> list[str]:
        """The ``tbf ...`` tail of a ``tc qdisc`` command."""
        return ["tbf", "rate", f"{self.rate_bit}bit", "burst", str(self.burst_bytes),
                "limit", str(self.limit_bytes)]


def tbf_params(mbit_per_s: float, *, burst_bytes: int | None = None) -> TbfParams:
    """tbf parameters for a link of ``mbit_per_s`` (SI: 1 Mbit = 10^6 bit, as tc reads "mbit").

    burst = max(rate * 4 ms, 4 frames of 1514 bytes);
    limit = burst + max(rate * 100 ms, 256 KiB).
    Measured TCP goodput is ~0.956 of the rate (frame overhead) from 1 to 100 Mbit/s, both ways.
    """
    if not mbit_per_s > 0:
        raise ValueError(f"mbit_per_s must be > 0, got {mbit_per_s}")
    rate_bytes = mbit_per_s * 1e6 / 8
    if burst_bytes is None:
        burst_bytes = max(_TBF_MIN_BURST_BYTES, int(rate_bytes * _TBF_BURST_S))
    elif burst_bytes < _FRAME_BYTES:
        raise ValueError(f"burst_bytes must hold one frame (>= {_FRAME_BYTES}), got {burst_bytes}")
    limit = burst_bytes + max(_TBF_MIN_QUEUE_BYTES, int(rate_bytes * _TBF_LATENCY_S))
    return TbfParams(rate_bit=round(mbit_per_s * 1e6), burst_bytes=burst_bytes, limit_bytes=limit)


def _run(args: list[str]) -> str:
    """Run a command; on failure raise NetnsError naming the command and its stderr."""
    try:
        done = subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as e:
        raise NetnsError(f"{args[0]} not found (running {' '.join(args)})") from e
    except subprocess.CalledProcessError as e:
        raise NetnsError(f"`{' '.join(args)}` failed ({e.returncode}): {e.stderr.strip()}") from e
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"`{' '.join(args)}` timed out") from e
    return done.stdout


def _try(args: list[str]) -> bool:
    """Run a teardown command; a failure (usually: already gone) is logged at debug."""
    try:
        _run(args)
    except NetnsError as e:
        logger.debug("[netns] %s", e)
        return False
    return True


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", "dev", name], capture_output=True).returncode == 0


def _namespace_exists(name: str) -> bool:
    return os.path.exists(f"/run/netns/{name}")


def _sanitise(host: str) -> str:
    return re.sub(r"[^a-z0-9_.-]+", "-", host.lower()).strip("-.") or "host"


class VirtualLan:
    """A bridge in the root namespace and one namespace per board behind it (needs root).

    Board ``index`` (1..253) gets ``{prefix}.{index + 1}``, so index 1 is ``.2`` and ``.1``
    stays the gateway's. Use as a context manager, or call :meth:`destroy` in ``finally``.
    """

    def __init__(self, *, name: str, subnet_prefix: str = "10.77.0") -> None:
        if not _LAN_NAME.match(name) or len(name) > MAX_LAN_NAME:
            raise ValueError(f"LAN name must be 1-{MAX_LAN_NAME} of [a-z0-9] starting with a "
                             f"letter (it prefixes interface names), got {name!r}")
        if not _PREFIX.match(subnet_prefix):
            raise ValueError(f"subnet_prefix must be three octets like '10.77.0', got {subnet_prefix!r}")
        self.name = name
        self.subnet_prefix = subnet_prefix
        self.bridge = f"{name}-br"
        self.gateway_ip = f"{subnet_prefix}.1"
        self.hosts: dict[str, HostNetwork] = {}
        self._created_bridge = False

    def __enter__(self) -> VirtualLan:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def create(self) -> None:
        """Make the bridge with the gateway IP, up, with multicast flooded so mDNS crosses it."""
        if _link_exists(self.bridge):
            raise NetnsError(f"bridge {self.bridge} already exists; another LAN uses name {self.name!r}")
        _run(["ip", "link", "add", "name", self.bridge, "type", "bridge",
              "mcast_snooping", "0", "stp_state", "0", "forward_delay", "0"])
        self._created_bridge = True
        _run(["ip", "link", "set", "dev", self.bridge, "multicast", "on"])
        _run(["ip", "addr", "add", f"{self.gateway_ip}/24", "dev", self.bridge])
        _run(["ip", "link", "set", "dev", self.bridge, "up"])
        logger.info("[netns] bridge %s up at %s/24", self.bridge, self.gateway_ip)

    def add_host(self, host: str, index: int) -> HostNetwork:
        """Make namespace ``{name}-{host}`` at ``{prefix}.{index + 1}``, routed via the gateway."""
        if not 1 <= index <= 253:
            raise ValueError(f"index must be 1..253 (the host gets .index+1), got {index}")
        if host in self.hosts:
            raise ValueError(f"host {host!r} is already on LAN {self.name}")
        ip = f"{self.subnet_prefix}.{index + 1}"
        namespace = f"{self.name}-{_sanitise(host)}"[:MAX_NAMESPACE_NAME]
        taken = {h.namespace: h for h in self.hosts.values()} | {h.ip: h for h in self.hosts.values()}
        if namespace in taken or ip in taken:
            raise ValueError(f"host {host!r} (namespace {namespace}, {ip}) clashes with another host")
        net = HostNetwork(namespace=namespace, ip=ip, veth_root=f"{self.name}-r{index}",
                          veth_ns=f"{self.name}-n{index}")
        if _namespace_exists(namespace) or _link_exists(net.veth_root):
            raise NetnsError(f"{namespace} or {net.veth_root} already exists; not ours to reuse")
        self.hosts[host] = net
        self._build_host(net)
        logger.info("[netns] host %s in %s at %s", host, namespace, ip)
        return net

    def _build_host(self, net: HostNetwork) -> None:
        ns = net.namespace
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", "name", net.veth_root, "type", "veth",
              "peer", "name", net.veth_ns, "netns", ns])
        _run(["ip", "link", "set", "dev", net.veth_root, "master", self.bridge])
        _run(["ip", "link", "set", "dev", net.veth_root, "up"])
        _run(["ip", "-n", ns, "link", "set", "dev", "lo", "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{net.ip}/24", "dev", net.veth_ns])
        _run(["ip", "-n", ns, "link", "set", "dev", net.veth_ns, "multicast", "on", "up"])
        _run(["ip", "-n", ns, "route", "add", "default", "via", self.gateway_ip])

    def set_rate(self, host: str, mbit_per_s: float, *, burst_bytes: int | None = None) -> TbfParams:
        """Limit ``host``'s link to ``mbit_per_s`` each way (tbf; see :func:`tbf_params`)."""
        net = self._host(host)
        params = tbf_params(mbit_per_s, burst_bytes=burst_bytes)
        _run(["tc", "qdisc", "replace", "dev", net.veth_root, "root", *params.tc_args()])
        _run(["tc", "-n", net.namespace, "qdisc", "replace", "dev", net.veth_ns, "root",
              *params.tc_args()])
        logger.info("[netns] %s limited to %.1f Mbit/s each way", host, mbit_per_s)
        return params

    def clear_rate(self, host: str) -> None:
        """Remove ``host``'s rate limit both ways; a no-op when there is none."""
        net = self._host(host)
        for prefix, dev in ((["tc"], net.veth_root), (["tc", "-n", net.namespace], net.veth_ns)):
            try:
                _run([*prefix, "qdisc", "del", "dev", dev, "root"])
            except NetnsError as e:
                if "handle of zero" not in str(e) and "No such file" not in str(e):
                    raise

    def set_link_up(self, host: str, up: bool) -> None:
        """Cut ``host``'s link (its veth on the bridge goes down: nothing passes either way, as
        when a cable is pulled) or restore it."""
        net = self._host(host)
        _run(["ip", "link", "set", "dev", net.veth_root, "up" if up else "down"])
        logger.info("[netns] %s link %s", host, "restored" if up else "cut")

    def exec_args(self, host: str) -> list[str]:
        """Prefix that runs a command inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self._host(host).namespace]

    def resources(self) -> dict:
        """Names of everything this LAN created, JSON-ready, for :func:`destroy_resources`."""
        return {
            "bridge": self.bridge if self._created_bridge else None,
            "namespaces": [h.namespace for h in self.hosts.values()],
            "veths": [h.veth_root for h in self.hosts.values()],
        }

    def destroy(self) -> None:
        """Delete every namespace, veth and the bridge made here; safe to call again."""
        destroy_resources(self.resources())
        self.hosts.clear()
        self._created_bridge = False

    def _host(self, host: str) -> HostNetwork:
        try:
            return self.hosts[host]
        except KeyError:
            raise KeyError(f"no host {host!r} on LAN {self.name} (have {sorted(self.hosts)})") from None


def destroy_resources(resources: dict) -> None:
    """Remove the namespaces, veths and bridge named in a :meth:`VirtualLan.resources` record.

    Items already gone are skipped (logged at debug); this never raises for them.
    """
    for namespace in resources.get("namespaces", []):
        if _namespace_exists(namespace):
            _try(["ip", "netns", "del", namespace])
    # A namespace still holding a process outlives `ip netns del`; deleting the root end of the
    # pair removes its peer inside it, so the board is cut off either way.
    for veth in resources.get("veths", []):
        if _link_exists(veth):
            _try(["ip", "link", "del", "dev", veth])
    bridge = resources.get("bridge")
    if bridge and _link_exists(bridge):
        _try(["ip", "link", "del", "dev", bridge])


def netns_available() -> tuple[bool, str]:
    """Whether a VirtualLan can be built here, and if not, why."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) not found"
    probe = f"etprobe-{uuid.uuid4().hex[:8]}"
    try:
        _run(["ip", "netns", "add", probe])
    except NetnsError as e:
        return False, f"cannot create a network namespace: {e}"
    _try(["ip", "netns", "del", probe])
    return True, "ok"
