"""Benchmark: our chunked tensor streams and the telemetry probe through tc-shaped fleet links.

For each tbf rate (10, 50, 100 Mbit/s) a board in its own network namespace, on the fleet's
virtual bridge, joins a real coordinator on the gateway, downloads the MobileNetV2 parameters
(9 MB) and uploads a gradient of the same size through the coordinator's gRPC streams, and runs
the telemetry link probe. Printed: the throughput of each stream and the probe's estimate as a
fraction of the rate. tbf counts whole Ethernet frames, so TCP payload tops out near 0.956 of
the rate. Needs root (network namespaces); the last line is one JSON object.

    sudo python scripts/bench_links.py [--rates 10,50,100] [--smoke] [--record]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch

from edgetrain.config import job_from_dict
from edgetrain.emulator.netns import VirtualLan, netns_available
from edgetrain.experiment.bench_output import add_bench_args, finish, stop_on_sigterm

MODEL = "mobilenet_v2"


def board_side(address: str) -> None:
    """Inside the namespace: join, time one download and one upload, probe the link."""
    from edge_client.connection import CoordinatorConnection
    from edge_client.telemetry import LinkMeter, probe_link
    from edgetrain.models import build_model
    from edgetrain.tensors import pack
    from edgetrain.training import shard_tensor_names
    from edgetrain.updates import UpdateFormats
    from edgetrain.work import BoardProfile, StepReport

    conn = CoordinatorConnection(address)
    device, job = conn.register("bench", None, "")
    conn.report_profile(device, BoardProfile(((8, 1.0),), 0, 0, 0))
    work = conn.get_work(device, 30)
    started = time.perf_counter()
    _, params = conn.download_parameters(device, work.param_version)
    download_s = time.perf_counter() - started
    model = build_model(MODEL)
    # the update in the layout the coordinator expects of this step's codec (gradients last layer first)
    wire, _ = UpdateFormats(shard_tensor_names(model))(work.codec).encode(
        {name: torch.zeros_like(t) for name, t in shard_tensor_names(model)}, None)
    metas, payload = pack(wire)
    report = StepReport(samples=len(work.indices), loss=0.0, correct=0, compute_s=0.0)
    started = time.perf_counter()
    conn.upload(device, work, metas, payload, report, job.chunk_bytes)
    upload_s = time.perf_counter() - started
    meter = LinkMeter()
    probes = [probe_link(lambda p: conn.probe(device, p), meter) for _ in range(3)]
    print(json.dumps({"download_bytes": len(params), "download_s": download_s, "upload_bytes": len(payload),
                      "upload_s": upload_s, "probe_mbit": statistics.median(probes)}))


def measure(rate: float, workdir: Path) -> dict:
    """One rate: a fresh LAN, coordinator and board; returns the board's measurements."""
    from coordinator.main import run_coordinator

    lan = VirtualLan(name=f"bl{uuid.uuid4().hex[:5]}", subnet_prefix=f"10.78.{int(rate) % 250}")
    stop = threading.Event()
    try:
        lan.create()
        host = lan.add_host("board", 1)
        lan.set_rate("board", rate)
        job = job_from_dict({"name": f"links-{rate:g}", "model": MODEL,
                             "dataset": {"name": "synthetic", "train_size": 256, "test_size": 64},
                             "training": {"global_batch": 8, "steps": 2, "step_timeout_s": 600,
                                          "heartbeat_timeout_s": 600}})
        port_file = workdir / f"port-{rate:g}"
        thread = threading.Thread(target=lambda: _serve(run_coordinator, job, lan.gateway_ip, port_file, workdir,
                                                        stop), daemon=True)
        thread.start()
        while not port_file.exists() or not port_file.read_text().strip():
            time.sleep(0.1)
        out = subprocess.run([*lan.exec_args("board"), sys.executable, __file__, "--board",
                              port_file.read_text().strip()], capture_output=True, text=True, timeout=900)
        if out.returncode:
            raise RuntimeError(f"board side failed at {rate} Mbit/s: {out.stderr[-2000:]}")
        assert host.ip
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        stop.set()
        lan.destroy()


def _serve(run_coordinator, job, ip: str, port_file: Path, workdir: Path, stop: threading.Event) -> None:
    try:
        run_coordinator(job, bind=f"{ip}:0", runs_dir=str(workdir / "runs"), port_file=str(port_file), stop=stop)
    except Exception:  # stopped mid-job by design once the board has measured
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="10,50,100", help="tbf rates, Mbit/s")
    parser.add_argument("--board", help=argparse.SUPPRESS)
    add_bench_args(parser)
    args = parser.parse_args()
    if args.board:
        board_side(args.board)
        return
    if args.smoke:
        args.rates = "50"
    stop_on_sigterm()
    ok, why = netns_available()
    if not ok:
        sys.exit(f"bench_links needs network namespaces (root): {why}")
    stream, probe = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_links_") as tmp:
        for rate in (float(r) for r in args.rates.split(",")):
            result = measure(rate, Path(tmp))
            down = result["download_bytes"] * 8 / result["download_s"] / 1e6
            up = result["upload_bytes"] * 8 / result["upload_s"] / 1e6
            stream[f"{rate:g}"] = round(min(down, up) / rate, 3)
            probe[f"{rate:g}"] = round(result["probe_mbit"] / rate, 3)
            print(f"tbf {rate:g} Mbit/s: download {down:.1f} Mbit/s ({down / rate:.2f}), upload {up:.1f} Mbit/s "
                  f"({up / rate:.2f}), probe {result['probe_mbit']:.1f} Mbit/s ({result['probe_mbit'] / rate:.2f})",
                  flush=True)
    finish(__file__, {"model": MODEL, "stream_fraction_of_rate": stream, "probe_fraction_of_rate": probe,
                      "stream": "min(download, upload) of a 9 MB parameter/gradient bundle"}, args)


if __name__ == "__main__":
    main()
