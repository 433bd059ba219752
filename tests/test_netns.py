"""The virtual LAN: namespaces behind a bridge, tbf rate limits both ways, complete teardown."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from edgetrain.emulator.netns import (
    NetnsError,
    VirtualLan,
    destroy_resources,
    netns_available,
    tbf_params,
)

_AVAILABLE, _REASON = netns_available()
needs_netns = pytest.mark.skipif(not _AVAILABLE, reason=_REASON)

_PEER = r"""
import socket, sys
host, port, nbytes, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with socket.create_connection((host, port), timeout=20) as s:
    if mode == "send":
        block = b"x" * 65536
        sent = 0
        while sent < nbytes:
            sent += s.send(block[: nbytes - sent])
        s.shutdown(socket.SHUT_WR)
        s.recv(1)
    else:
        got = 0
        while got < nbytes:
            data = s.recv(1 << 20)
            if not data:
                break
            got += len(data)
        s.sendall(b"k")
        print(got)
"""


def _listener(ip: str) -> socket.socket:
    server = socket.socket()
    server.bind((ip, 0))
    server.listen(1)
    server.settimeout(20)
    return server


def _receive_all(server: socket.socket, result: dict) -> None:
    """Accept one peer, count what it sends; rate from first to last byte."""
    conn, _ = server.accept()
    with conn:
        first = last = None
        got = first_len = 0
        while data := conn.recv(1 << 20):
            last = time.perf_counter()
            if first is None:
                first, first_len = last, len(data)
            got += len(data)
        conn.sendall(b"k")
    result["bytes"], result["seconds"] = got - first_len, (last - first) if first else 0.0


def _send_all(server: socket.socket, nbytes: int, result: dict) -> None:
    """Accept one peer, send it nbytes; rate until it acknowledges the last byte."""
    conn, _ = server.accept()
    with conn:
        start = time.perf_counter()
        conn.sendall(b"x" * nbytes)
        conn.recv(1)
        result["bytes"], result["seconds"] = nbytes, time.perf_counter() - start


def measure_mbit(lan: VirtualLan, host: str, *, nbytes: int, upload: bool) -> float:
    """TCP goodput between ``host``'s namespace and a server on the gateway IP, in Mbit/s."""
    server = _listener(lan.gateway_ip)
    result: dict = {}
    target = (_receive_all, (server, result)) if upload else (_send_all, (server, nbytes, result))
    thread = threading.Thread(target=target[0], args=target[1], daemon=True)
    thread.start()
    mode = "send" if upload else "recv"
    args = [*lan.exec_args(host), sys.executable, "-c", _PEER, lan.gateway_ip,
            str(server.getsockname()[1]), str(nbytes), mode]
    try:
        subprocess.run(args, check=True, capture_output=True, timeout=60)
        thread.join(timeout=20)
    finally:
        server.close()
    assert result, "the transfer did not complete"
    return result["bytes"] * 8 / result["seconds"] / 1e6


def _unique_lan() -> VirtualLan:
    name = "t" + uuid.uuid4().hex[:7]
    prefix = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
    return VirtualLan(name=name, subnet_prefix=prefix)


def _listed() -> str:
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return links + namespaces


@pytest.fixture
def lan() -> Iterator[VirtualLan]:
    lan = _unique_lan()
    try:
        lan.create()
        lan.add_host("board-a", 1)
        lan.add_host("Board B!", 2)
        yield lan
    finally:
        lan.destroy()
    assert lan.name not in _listed()


def test_names_and_params_are_validated() -> None:
    with pytest.raises(ValueError, match="LAN name"):
        VirtualLan(name="much-too-long-name")
    with pytest.raises(ValueError, match="subnet_prefix"):
        VirtualLan(name="ok", subnet_prefix="10.300.0")
    with pytest.raises(ValueError, match="mbit_per_s"):
        tbf_params(0)
    with pytest.raises(ValueError, match="burst_bytes"):
        tbf_params(10, burst_bytes=100)


def test_tbf_params_follow_the_documented_formula() -> None:
    slow, fast = tbf_params(1), tbf_params(1000)
    assert slow.rate_bit == 1_000_000 and fast.rate_bit == 1_000_000_000
    assert slow.burst_bytes == 4 * 1_514 and fast.burst_bytes == 500_000
    assert slow.limit_bytes == slow.burst_bytes + 256 * 1024
    assert fast.limit_bytes == 500_000 + 12_500_000


@pytest.mark.root
@needs_netns
def test_hosts_reach_the_gateway_and_each_other(lan: VirtualLan) -> None:
    # Prepare
    a, b = lan.hosts["board-a"], lan.hosts["Board B!"]
    probe = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 5).close()"
    server = _listener(lan.gateway_ip)
    port = str(server.getsockname()[1])
    peer = subprocess.Popen([*lan.exec_args("Board B!"), sys.executable, "-c",
                             "import socket,sys; s=socket.create_server((sys.argv[1], 7777)); "
                             "print('up', flush=True); s.accept()", b.ip], stdout=subprocess.PIPE)
    try:
        assert peer.stdout.readline().strip() == b"up"
        # Execute
        to_gateway = subprocess.run([*lan.exec_args("board-a"), sys.executable, "-c", probe,
                                     lan.gateway_ip, port], capture_output=True, timeout=20)
        to_peer = subprocess.run([*lan.exec_args("board-a"), sys.executable, "-c", probe,
                                  b.ip, "7777"], capture_output=True, timeout=20)
    finally:
        server.close()
        peer.kill()
        peer.wait()
    # Assert
    assert a.ip == f"{lan.subnet_prefix}.2" and b.ip == f"{lan.subnet_prefix}.3"
    assert b.namespace == f"{lan.name}-board-b"
    assert to_gateway.returncode == 0, to_gateway.stderr
    assert to_peer.returncode == 0, to_peer.stderr


@pytest.mark.root
@needs_netns
def test_multicast_crosses_the_bridge(lan: VirtualLan) -> None:
    # Prepare: a receiver on the gateway joined to an mDNS-like group on the bridge
    group = "224.0.0.251"
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    receiver.bind(("", 0))
    port = receiver.getsockname()[1]
    receiver.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                        socket.inet_aton(group) + socket.inet_aton(lan.gateway_ip))
    receiver.settimeout(10)
    sender = ("import socket,sys; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
              "s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1); "
              "s.sendto(b'hello', (sys.argv[1], int(sys.argv[2])))")
    try:
        # Execute
        subprocess.run([*lan.exec_args("board-a"), sys.executable, "-c", sender, group, str(port)],
                       check=True, capture_output=True, timeout=20)
        data, source = receiver.recvfrom(64)
    finally:
        receiver.close()
    # Assert
    assert data == b"hello" and source[0] == lan.hosts["board-a"].ip


@pytest.mark.root
@needs_netns
@pytest.mark.timeout(120)
def test_rate_limit_holds_both_ways(lan: VirtualLan) -> None:
    # Prepare
    mbit = 20.0
    nbytes = int(mbit * 1e6 / 8 * 2)  # about two seconds of transfer
    lan.set_rate("board-a", mbit)
    # Execute
    up = measure_mbit(lan, "board-a", nbytes=nbytes, upload=True)
    down = measure_mbit(lan, "board-a", nbytes=nbytes, upload=False)
    unshaped = measure_mbit(lan, "Board B!", nbytes=nbytes, upload=True)
    lan.clear_rate("board-a")
    lan.clear_rate("board-a")
    cleared = measure_mbit(lan, "board-a", nbytes=nbytes, upload=True)
    # Assert
    assert 0.85 * mbit <= up <= 1.15 * mbit, up
    assert 0.85 * mbit <= down <= 1.15 * mbit, down
    assert unshaped > 3 * mbit and cleared > 3 * mbit, (unshaped, cleared)


@pytest.mark.root
@needs_netns
def test_destroy_removes_everything_and_is_idempotent() -> None:
    lan = _unique_lan()
    try:
        # Prepare
        lan.create()
        net = lan.add_host("solo", 1)
        assert net.namespace in _listed() and lan.bridge in _listed()
        # Execute
        lan.destroy()
        lan.destroy()
    finally:
        lan.destroy()
    # Assert
    assert lan.name not in _listed()


@pytest.mark.root
@needs_netns
def test_destroy_resources_from_the_record_alone() -> None:
    # Prepare: build a LAN, keep only its record, "lose" the object
    lan = _unique_lan()
    try:
        lan.create()
        lan.add_host("x", 1)
        lan.add_host("y", 7)
        lan.set_rate("y", 5)
        record = lan.resources()
        name = lan.name
    except BaseException:
        lan.destroy()
        raise
    del lan
    # Execute
    try:
        destroy_resources(record)
        destroy_resources(record)
    finally:
        destroy_resources(record)
    # Assert
    assert record["bridge"] == f"{name}-br" and len(record["namespaces"]) == 2
    assert name not in _listed()


@pytest.mark.root
@needs_netns
def test_clashes_fail_clearly(lan: VirtualLan) -> None:
    with pytest.raises(ValueError, match="clashes"):
        lan.add_host("other", 1)
    with pytest.raises(ValueError, match="already"):
        lan.add_host("board-a", 5)
    with pytest.raises(KeyError, match="no host"):
        lan.set_rate("nobody", 10)
    twin = VirtualLan(name=lan.name, subnet_prefix=lan.subnet_prefix)
    with pytest.raises(NetnsError, match="already exists"):
        twin.create()
