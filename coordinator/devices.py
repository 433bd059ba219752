"""`edgetrain devices`: the coordinators advertised on the LAN and the boards each one knows."""

from __future__ import annotations

import json

import grpc
from google.protobuf.json_format import MessageToDict

from edgetrain import transport
from edgetrain.discovery import browse, default_interfaces
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc

UNKNOWN = "?"


def _fetch(address: str, security: transport.Security) -> pb.ListDevicesReply:
    with transport.open_channel(address, security) as channel:
        return pb_grpc.CoordinatorStub(channel).ListDevices(pb.ListDevicesRequest(), timeout=10)


def _fleet_of(security: transport.Security) -> str:
    """The CA fingerprint of the fleet `security` belongs to ("" for plaintext)."""
    credentials = getattr(security, "credentials", None)
    return credentials.identity.ca_fingerprint if credentials is not None else ""


def _not_ours(record, fleet: str) -> str:
    if not record.ca_fingerprint:
        return "not asked: it serves without TLS (--insecure); list it with --insecure"
    if not fleet:
        return f"not asked: it serves mutual TLS (fleet CA {record.ca_fingerprint[:16]}…); list it without --insecure"
    return f"not asked: another fleet (CA {record.ca_fingerprint[:16]}…) than this credential's"


def _fmt(telemetry: pb.Telemetry, name: str, spec: str, scale: float = 1.0) -> str:
    return format(getattr(telemetry, name) * scale, spec) if telemetry.HasField(name) else UNKNOWN


def _row(view: pb.DeviceView) -> str:
    t = view.telemetry
    battery = UNKNOWN
    if t.HasField("battery_percent"):
        battery = f"{t.battery_percent:.1f}%" + ("+" if t.battery_charging else "")
    memory = f"{t.memory_used_bytes / 2**30:.1f}/{t.memory_total_bytes / 2**30:.1f}G" if t.HasField(
        "memory_total_bytes") else UNKNOWN
    energy = UNKNOWN
    if view.HasField("energy_per_sample_j"):  # "~": estimated from a power model, not measured
        energy = f"{view.energy_per_sample_j:.2f}" + ("" if t.energy_measured else "~")
    speed = f"{view.samples_per_s:.1f}" if view.HasField("samples_per_s") else UNKNOWN
    return (f"{view.device_id:<16}{view.state:<11}{view.seconds_since_seen:>6.1f}{_fmt(t, 'cpu_percent', '.0f'):>6}"
            f"{memory:>12}{battery:>9}{_fmt(t, 'temperature_c', '.0f'):>6}{_fmt(t, 'link_mbit_per_s', '.1f'):>9}"
            f"{_fmt(t, 'rtt_ms', '.1f'):>8}{speed:>10}{view.samples_done:>9}{energy:>9}"
            f"  {view.codec or '-':<10}{view.rejected_updates:>4}")


HEADER = (f"{'device':<16}{'state':<11}{'seen':>6}{'cpu%':>6}{'memory':>12}{'battery':>9}{'temp':>6}"
          f"{'Mbit/s':>9}{'rtt ms':>8}{'samples/s':>10}{'samples':>9}{'J/sample':>9}  {'codec':<10}{'bad':>4}")


def devices_report(*, coordinator: str | None = None, interfaces: list[str] | None = None,
                   as_json: bool = False, security: transport.Security = transport.INSECURE) -> str:
    """A table (or JSON) of every coordinator found and the boards it has admitted, asked with
    `security` (a fleet credential: listing devices needs one; plaintext only for --insecure)."""
    if coordinator:
        targets = [(coordinator, None)]
    else:
        targets = [(r.address, r) for r in browse(interfaces=interfaces or default_interfaces())]
    fleet = _fleet_of(security)
    results = []
    for address, record in targets:
        if record is not None and record.ca_fingerprint != fleet:  # TLS to plaintext, or another CA: no handshake
            results.append((address, record, None, _not_ours(record, fleet)))
            continue
        try:
            results.append((address, record, _fetch(address, security), None))
        except grpc.RpcError as e:
            results.append((address, record, None, f"unreachable ({e.code().name}: {e.details()})"))
    if as_json:
        return json.dumps([{"address": a, "cluster": reply.cluster if reply else (r.cluster if r else None),
                            "job": reply.job_id if reply else None, "error": err,
                            "devices": [MessageToDict(d, preserving_proto_field_name=True) for d in reply.devices]
                            if reply else []} for a, r, reply, err in results], indent=2)
    if not results:
        return "no coordinator advertised on " + ", ".join(interfaces or default_interfaces())
    lines = []
    for address, _, reply, error in results:
        if reply is None:
            lines += [f"coordinator {address}: {error}", ""]
            continue
        lines += [f"coordinator {address}  cluster {reply.cluster}  job {reply.job_id}  "
                  f"({len(reply.devices)} boards; ? = the board cannot report it)", HEADER]
        lines += [_row(view) for view in reply.devices]
        if any(v.HasField("energy_per_sample_j") and not v.telemetry.energy_measured for v in reply.devices):
            lines.append("~ energy estimated from the board's power model (busy/idle W + radio nJ/byte), not measured")
        lines += [f"flagged: {view.device_id} {view.speed_claim}" for view in reply.devices if view.speed_claim] + [""]
    return "\n".join(lines).rstrip()
