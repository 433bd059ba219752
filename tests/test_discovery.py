"""Tests for mDNS discovery: coordinator/discovery.py advertises, edge_client/discovery.py finds.

Real zeroconf, pinned to 127.0.0.1 (or to a bridge and a namespace this test creates). Every
test uses its own cluster names, so tests running in parallel ignore each other's adverts.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from coordinator.advertiser import Advertisement, DiscoveryAdvertiser
from edgetrain.discovery import (
    QUIET_S,
    CoordinatorNotFound,
    CoordinatorRecord,
    browse,
    find_coordinator,
)

LOOPBACK = ["127.0.0.1"]
mdns = pytest.mark.timeout(60)


def _cluster(label: str) -> str:
    return f"{label}-{secrets.token_hex(4)}"


def _advertiser(cluster: str, port: int, *, proto: int = 1, ca: str = "",
                instance: str | None = None, host: str = "127.0.0.1") -> DiscoveryAdvertiser:
    ad = Advertisement(cluster=cluster, host=host, port=port, protocol_version=proto,
                       ca_fingerprint=ca, instance=instance)
    return DiscoveryAdvertiser(ad, interfaces=[host])


def _ours(records: list[CoordinatorRecord], *clusters: str) -> list[CoordinatorRecord]:
    return [r for r in records if r.cluster in clusters]


def _browse_ours(cluster: str, count: int = 1, timeout_s: float = 30.0) -> list[CoordinatorRecord]:
    """Our cluster's records, browsing again until there are `count` of them.

    A browse ends once nothing new has appeared for QUIET_S. Beside other adverts (another
    test's on the other xdist worker, a fleet's) on a loaded machine, that can come before ours
    resolved; a caller that wants one coordinator uses find_coordinator, which waits for it."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = _ours(browse(interfaces=LOOPBACK, timeout_s=5.0), cluster)
        if len(found) >= count or time.monotonic() > deadline:
            return found


def _refusal(find: Callable[[], object], *named: str, timeout_s: float = 30.0) -> CoordinatorNotFound:
    """The CoordinatorNotFound `find` raises, asking again until its message names all of `named`
    (what a browse saw before it went quiet: see _browse_ours)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = find()
        except CoordinatorNotFound as e:
            if all(n in str(e) for n in named) or time.monotonic() > deadline:
                return e
        else:
            assert time.monotonic() < deadline, f"no CoordinatorNotFound, found {found}"


def test_advertisement_defaults_to_a_dns_safe_instance_name() -> None:
    ad = Advertisement(cluster="my lab_1", host="127.0.0.1", port=5000, protocol_version=1)

    assert ad.instance is not None and ad.instance.startswith("my-lab-1-")
    assert ad.instance.endswith("-5000")
    assert all(c.isalnum() or c == "-" for c in ad.instance)
    assert ad.txt() == {"proto": "1", "cluster": "my lab_1", "tls": "0", "ca": ""}


@pytest.mark.parametrize("field, value", [("host", "lab.local"), ("port", 0), ("cluster", ""),
                                          ("cluster", "x" * 255), ("protocol_version", -1)])
def test_advertisement_rejects_bad_values(field: str, value: object) -> None:
    fields = {"cluster": "lab", "host": "127.0.0.1", "port": 5000, "protocol_version": 1}

    with pytest.raises(ValueError, match=field):
        Advertisement(**{**fields, field: value})


@mdns
def test_browse_finds_the_advert_and_forgets_it_after_close() -> None:
    # Prepare
    cluster = _cluster("basic")
    advertiser = _advertiser(cluster, 50101, proto=7, ca="ab" * 32)
    started = time.monotonic()
    advertiser.start()
    print(f"advertise took {time.monotonic() - started:.2f} s")
    try:
        # Execute
        started = time.monotonic()
        found = _browse_ours(cluster)
        print(f"browse took {time.monotonic() - started:.2f} s")
    finally:
        advertiser.close()
        advertiser.close()

    # Assert
    assert found == [CoordinatorRecord(instance=advertiser.instance, cluster=cluster,
                                       address="127.0.0.1:50101", protocol_version=7,
                                       tls=True, ca_fingerprint="ab" * 32)]
    deadline = time.monotonic() + 10.0
    while _ours(browse(interfaces=LOOPBACK, timeout_s=1.5), cluster):
        assert time.monotonic() < deadline, "advert still visible 10 s after close()"


@mdns
def test_find_coordinator_picks_the_requested_cluster() -> None:
    # Prepare
    lab, field = _cluster("lab"), _cluster("field")
    with _advertiser(lab, 50201), _advertiser(field, 50202):
        # Execute
        picked = find_coordinator(interfaces=LOOPBACK, cluster=field, timeout_s=10.0)
        ambiguous = _refusal(lambda: find_coordinator(interfaces=LOOPBACK, timeout_s=10.0), lab, field)
        unknown = _refusal(lambda: find_coordinator(interfaces=LOOPBACK, cluster=_cluster("nowhere"), timeout_s=2.0),
                           f"'{lab}' at 127.0.0.1:50201")

    # Assert
    assert (picked.cluster, picked.address) == (field, "127.0.0.1:50202")
    assert lab in str(ambiguous) and field in str(ambiguous)
    assert "--cluster" in str(ambiguous)
    assert "no coordinator for cluster 'nowhere-" in str(unknown)
    assert "within 2 s" in str(unknown)
    assert f"'{lab}' at 127.0.0.1:50201" in str(unknown)


@mdns
@pytest.mark.slow
def test_find_coordinator_skips_other_protocol_versions() -> None:
    # Prepare
    cluster, old_only = _cluster("proto"), _cluster("old")
    with (_advertiser(cluster, 50301, proto=2, instance=f"a-{cluster}"),
          _advertiser(cluster, 50302, proto=3, instance=f"b-{cluster}"),
          _advertiser(old_only, 50303, proto=2)):
        # Execute
        picked = find_coordinator(interfaces=LOOPBACK, cluster=cluster, protocol_version=3)
        mismatch = _refusal(lambda: find_coordinator(interfaces=LOOPBACK, cluster=old_only, protocol_version=3,
                                                     timeout_s=2.0),
                            f"'{old_only}' at 127.0.0.1:50303 (protocol 2, skipped)")

    # Assert
    assert picked.address == "127.0.0.1:50302"
    assert "speaking protocol 3" in str(mismatch)
    assert f"'{old_only}' at 127.0.0.1:50303 (protocol 2, skipped)" in str(mismatch)


@mdns
@pytest.mark.slow
def test_several_instances_of_one_cluster_first_instance_name_wins() -> None:
    # Prepare
    cluster = _cluster("dup")
    with (_advertiser(cluster, 50401, instance=f"b-{cluster}"),
          _advertiser(cluster, 50402, instance=f"a-{cluster}")):
        # Execute
        picked = find_coordinator(interfaces=LOOPBACK, cluster=cluster)
        seen = _browse_ours(cluster, count=2)

    # Assert: both are seen, in instance-name order, and find_coordinator takes the first by name of
    # those its browse saw (on a loaded machine that browse may go quiet before the second
    # answers, so either is a correct pick; the ordering rule itself is browse's, checked here)
    assert picked.instance in (f"a-{cluster}", f"b-{cluster}")
    assert [r.address for r in seen] == ["127.0.0.1:50402", "127.0.0.1:50401"]


@mdns
@pytest.mark.slow
def test_find_coordinator_sees_a_restarted_coordinator_at_its_new_port() -> None:
    # Prepare
    cluster = _cluster("restart")
    with _advertiser(cluster, 50601):
        before = find_coordinator(interfaces=LOOPBACK, cluster=cluster)

    # Execute
    with _advertiser(cluster, 50602):
        after = find_coordinator(interfaces=LOOPBACK, cluster=cluster)

    # Assert
    assert (before.address, after.address) == ("127.0.0.1:50601", "127.0.0.1:50602")


# --- Between network namespaces joined by a bridge --------------------------------------------


@dataclass(frozen=True)
class BridgedNamespace:
    """A netns whose veth hangs off a bridge in the root namespace."""

    netns: str
    host_ip: str
    """The bridge's address in the root namespace."""
    ns_ip: str
    """The veth's address inside ``netns``."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def _free_subnet() -> int:
    """A third octet x such that 10.231.x.0/24 is not in use in the root namespace."""
    used = _ip("-4", "route").stdout + _ip("-4", "addr").stdout
    free = [x for x in range(1, 255) if f"10.231.{x}." not in used]
    return random.choice(free)


@pytest.fixture
def bridged_netns() -> Iterator[BridgedNamespace]:
    """Bridge (root ns) <- veth -> netns, all unique names; everything removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (`ip`) to build network namespaces")
    suffix = secrets.token_hex(3)
    bridge, veth_host, veth_ns, netns = (f"et-{kind}-{suffix}" for kind in ("br", "vh", "vn", "ns"))
    x = _free_subnet()
    net = BridgedNamespace(netns=netns, host_ip=f"10.231.{x}.1", ns_ip=f"10.231.{x}.2")
    try:
        if (probe := _ip("netns", "add", netns, check=False)).returncode != 0:
            pytest.skip(f"`ip netns add` failed: {probe.stderr.strip()}")
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{net.host_ip}/24", "dev", bridge)
        _ip("link", "set", bridge, "multicast", "on", "up")
        _ip("link", "add", veth_host, "type", "veth", "peer", "name", veth_ns, "netns", netns)
        _ip("link", "set", veth_host, "master", bridge, "multicast", "on", "up")
        _ip("-n", netns, "addr", "add", f"{net.ns_ip}/24", "dev", veth_ns)
        _ip("-n", netns, "link", "set", veth_ns, "multicast", "on", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        yield net
    finally:
        _ip("netns", "del", netns, check=False)
        _ip("link", "del", veth_host, check=False)
        _ip("link", "del", bridge, check=False)
        assert netns not in _ip("netns", "list").stdout
        links = _ip("-o", "link").stdout
        assert all(name not in links for name in (bridge, veth_host, veth_ns))


BROWSE_IN_NETNS = textwrap.dedent("""
    import json, sys, time
    from dataclasses import asdict
    from edgetrain.discovery import browse
    started = time.monotonic()
    records = browse(interfaces=[sys.argv[1]], timeout_s=float(sys.argv[2]))
    elapsed = time.monotonic() - started
    print(json.dumps({"elapsed_s": elapsed, "records": [asdict(r) for r in records]}))
""")


@mdns
@pytest.mark.root
@pytest.mark.slow
def test_browse_from_another_namespace_over_a_bridge(bridged_netns: BridgedNamespace) -> None:
    # Prepare
    net, cluster = bridged_netns, _cluster("bridge")
    started = time.monotonic()
    with _advertiser(cluster, 50501, host=net.host_ip):
        print(f"advertise on {net.host_ip} took {time.monotonic() - started:.2f} s")

        # Execute
        started = time.monotonic()
        out = subprocess.run(
            ["ip", "netns", "exec", net.netns, sys.executable, "-c", BROWSE_IN_NETNS,
             net.ns_ip, "5.0"],
            capture_output=True, text=True, timeout=30, check=True,
        )
        wall_s = time.monotonic() - started

    # Assert
    result = json.loads(out.stdout)
    print(f"browse in {net.netns} took {result['elapsed_s']:.2f} s "
          f"(incl. {QUIET_S} s quiet period); subprocess {wall_s:.2f} s")
    found = [r for r in result["records"] if r["cluster"] == cluster]
    assert [r["address"] for r in found] == [f"{net.host_ip}:50501"]
