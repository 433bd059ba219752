"""The live dashboard: its access token, its JSON snapshot and Prometheus metrics against
metrics.jsonl, HTTPS with the gateway's certificate, and a real coordinator training on real
boards behind it (a board killed mid-run turns "lost")."""

from __future__ import annotations

import http.client
import json
import ssl
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import read_metrics, small_job, wait_for
from prometheus_client.parser import text_string_to_metric_families

from coordinator.dashboard.server import COOKIE, DashboardServer
from coordinator.dashboard.view import MetricsTail, RunView
from coordinator.registry import DeviceRegistry
from edgetrain import trust
from edgetrain.telemetry import TelemetrySample
from edgetrain.work import BoardProfile


def _get(server_or_url, path: str, *, token: str | None = None, bearer: str | None = None,
         cookie: str | None = None, context: ssl.SSLContext | None = None) -> http.client.HTTPResponse:
    if isinstance(server_or_url, str):
        parts = urlsplit(server_or_url)
        host, port, scheme = parts.hostname, parts.port, parts.scheme
    else:
        host, port, scheme = server_or_url.host, server_or_url.port, server_or_url.scheme
    conn = (http.client.HTTPSConnection(host, port, timeout=10, context=context) if scheme == "https"
            else http.client.HTTPConnection(host, port, timeout=10))
    headers = {}
    if bearer:
        headers["Authorization"] = f"Bearer {bearer}"
    if cookie:
        headers["Cookie"] = f"{COOKIE}={cookie}"
    conn.request("GET", path + (f"?token={token}" if token else ""), headers=headers)
    response = conn.getresponse()
    response.body = response.read()
    conn.close()
    return response


def _metrics(body: bytes) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, parsed with Prometheus's own text parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def _registry_with_two_boards() -> DeviceRegistry:
    registry = DeviceRegistry()
    a = registry.register("a", {"emulated_speed": 0.5}, {})
    registry.register("b", {}, {})
    registry.heartbeat(a.device_id, TelemetrySample(timestamp=time.time(), cpu_percent=42.0, link_mbit_per_s=80.0,
                                                    rtt_ms=1.5, battery_percent=None))
    registry.count_bytes(a.device_id, down=1000, up=2000)
    registry.set_profile(a.device_id, BoardProfile(((8, 0.5), (32, 1.5)), 2**30, 2**29, 2**27))
    return registry


@pytest.fixture
def served(tmp_path: Path):
    """A dashboard over a registry of two boards and a run directory with two steps written."""
    registry = _registry_with_two_boards()
    a_id = next(r.device_id for r in registry.snapshot() if r.name == "a")
    records = [{"kind": "train", "step": s, "time": 100.0 + s, "loss": 2.0 - s / 10, "samples_per_s": 30.0 + s,
                "step_s": 1.5, "predicted_step_s": 1.4, "shares": {a_id: 16},
                "devices": {a_id: {"compute_s": 1.0, "comm_s": 0.3, "waiting_s": 0.1, "idle_s": 0.1,
                                   "energy_j": 2.0}}} for s in range(2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    view = RunView("job-x", tmp_path, registry, synthetic=True)
    server = DashboardServer("127.0.0.1:0", view.state)
    yield server, records, a_id
    server.close()


def test_every_route_refuses_a_request_without_the_token(served) -> None:
    server, _, _ = served
    for path in ("/", "/static/app.js", "/api/state", "/events", "/metrics", "/nowhere"):
        for credentials in ({}, {"token": "wrong"}, {"bearer": "wrong"}, {"cookie": "wrong"}):
            response = _get(server, path, **credentials)
            assert response.status == 401, (path, credentials)
            assert b"unauthorized" in response.body and b"job-x" not in response.body


def test_the_printed_url_opens_the_page_and_leaves_a_session_cookie(served) -> None:
    # Execute: the URL as printed, then the page with the cookie it set
    server, _, _ = served
    first = _get(server.url, "/", token=server.token)
    cookie = first.getheader("Set-Cookie")
    page = _get(server, "/", cookie=server.token)
    script = _get(server, "/static/app.js", cookie=server.token)

    # Assert: a redirect that drops the token from the address; HttpOnly, same-site cookie
    assert first.status == 303 and first.getheader("Location") == "/"
    assert cookie.startswith(f"{COOKIE}={server.token};") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert page.status == 200 and b"<title>EdgeTrain</title>" in page.body and b"SYNTHETIC DATA" in page.body
    assert script.status == 200 and script.getheader("Content-Type").startswith("text/javascript")
    assert "default-src 'self'" in page.getheader("Content-Security-Policy")  # no CDN, no inline script
    assert _get(server, "/static/../server.py", cookie=server.token).status == 404
    assert _get(server, "/static/missing.js", cookie=server.token).status == 404


def test_state_and_metrics_say_what_the_registry_and_metrics_jsonl_hold(served, tmp_path: Path) -> None:
    server, records, a_id = served
    # Execute: a third step is appended while the server runs, half a line at a time
    third = {**records[1], "step": 2, "loss": 1.7, "samples_per_s": 33.0}
    line = json.dumps(third) + "\n"
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(line[:20])
        f.flush()
        before = json.loads(_get(server, "/api/state", bearer=server.token).body)
        f.write(line[20:])

    def state_now() -> dict:
        return json.loads(_get(server, "/api/state", bearer=server.token).body)

    # the snapshot is shared by every viewer and made at most once a second: the step shows up within it
    wait_for(lambda: len(state_now()["curves"]) == 3, 10, "the third step in the snapshot", interval_s=0.1)
    state = state_now()
    metrics = _metrics(_get(server, "/metrics", bearer=server.token).body)

    # Assert: the half-written line was not read early; then every step is there
    assert [c["step"] for c in before["curves"]] == [0, 1]
    assert [c["step"] for c in state["curves"]] == [0, 1, 2] and state["synthetic_data"] is True
    boards = {b["name"]: b for b in state["boards"]}
    assert boards["a"]["state"] == "training" and boards["a"]["share"] == 16 and boards["a"]["role"] == "shard"
    assert boards["b"]["state"] == "joining" and boards["b"]["cpu_percent"] is None
    assert state["timeline"][-1]["boards"]["a"] == {"compute_s": 1.0, "comm_s": 0.3, "waiting_s": 0.1,
                                                     "idle_s": 0.1}
    # the plan the last step ran (no planner: the proportional split), predicted against measured
    assert state["plan"] == {"kind": "dp", "source": "proportional split", "stages": [],
                             "shards": [{"name": "a", "samples": 16}], "microbatches": None, "schedule": None,
                             "local": [], "measured": None, "left_out": {}, "predicted_step_s": 1.4,
                             "measured_step_s": 1.5, "step": 2}
    assert state["ideal_samples_per_s"] == pytest.approx(32 / 1.5, abs=0.01)  # a's best profiled batch; b has none
    job = ("job", "job-x")
    assert metrics[("edgetrain_loss", (job,))] == pytest.approx(1.7)
    assert metrics[("edgetrain_samples_per_second", (job,))] == pytest.approx(33.0)
    assert metrics[("edgetrain_steps_applied", (job,))] == 3
    assert metrics[("edgetrain_board_cpu_percent", (("board", "a"), job))] == 42.0
    assert metrics[("edgetrain_board_download_bytes_total", (("board", "a"), job))] == 1000
    assert metrics[("edgetrain_board_upload_bytes_total", (("board", "a"), job))] == 2000
    assert ("edgetrain_board_battery_percent", (("board", "a"), job)) not in metrics  # unknown: absent, not 0
    assert metrics[("edgetrain_board_up", (("board", "b"), job))] == 1


def test_metrics_tail_skips_what_is_not_a_record(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.new_records() == []  # no file yet
    path.write_text('{"kind": "train", "step": 0}\nnot json\n[1, 2]\n{"kind": "eval"')
    assert tail.new_records() == [{"kind": "train", "step": 0}]
    with path.open("a") as f:
        f.write(', "step": 0}\n')
    assert tail.new_records() == [{"kind": "eval", "step": 0}]


def test_from_the_lan_it_serves_https_with_the_gateway_certificate(tmp_path: Path) -> None:
    # Prepare: a fleet authority; the dashboard with the gateway's identity
    authority = trust.Authority.create(tmp_path / "ca")
    gateway = authority.gateway_identity()
    server = DashboardServer("127.0.0.1:0", RunView("job-tls", tmp_path, DeviceRegistry(), synthetic=False).state,
                             tls=gateway)
    try:
        verified = ssl.create_default_context(cadata=gateway.ca.decode())
        verified.check_hostname = False  # the certificate names the gateway, not 127.0.0.1
        # Execute
        state = _get(server, "/api/state", bearer=server.token, context=verified)
        refused = _get(server, "/api/state", context=verified)
        # Assert
        assert server.url.startswith("https://")
        assert state.status == 200 and json.loads(state.body)["job"] == "job-tls"
        assert refused.status == 401
        with pytest.raises(ssl.SSLCertVerificationError):  # a client that trusts another CA is not fooled
            _get(server, "/api/state", bearer=server.token, context=ssl.create_default_context())
    finally:
        server.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_training_coordinator_shows_its_boards_steps_and_a_killed_board_as_lost(
        coordinator_factory, client_factory) -> None:
    # Prepare: a real coordinator with its dashboard; three real boards
    job = small_job(training={"steps": 400, "min_clients": 3, "global_batch": 24, "heartbeat_timeout_s": 3.0,
                              "tensorboard": True})
    coordinator = coordinator_factory(job, dashboard="127.0.0.1:0")
    url = (coordinator.run_dir / "dashboard.url").read_text().strip()
    token = url.rsplit("token=", 1)[1]
    victim = client_factory(coordinator.address, "victim", 0.5)
    for name in ("a", "c"):
        client_factory(coordinator.address, name, 0.5)
    wait_for(lambda: len(read_metrics(coordinator.run_dir)) >= 3, 120, "three steps", interval_s=0.2)

    # Execute: read the dashboard; kill a board; read it again
    state = json.loads(_get(url, "/api/state", bearer=token).body)
    metrics = _metrics(_get(url, "/metrics", bearer=token).body)
    written = read_metrics(coordinator.run_dir)
    victim.kill()

    def victim_state() -> str:
        boards = json.loads(_get(url, "/api/state", bearer=token).body)["boards"]
        return next(b["state"] for b in boards if b["name"] == "victim")

    wait_for(lambda: victim_state() == "lost", 60, "the killed board to show as lost", interval_s=0.2)

    # `edgetrain dashboard` on the gateway prints the live page's URL (from the owner-only file)
    import contextlib
    import io

    from edgetrain.cli import main as edgetrain

    listing = io.StringIO()
    with contextlib.redirect_stdout(listing):
        assert edgetrain(["dashboard", "--runs-dir", str(coordinator.run_dir.parent)]) == 0
    assert listing.getvalue() == f"{job.name}  {url}\n"

    # Assert: every board, the steps metrics.jsonl had, the same numbers in /metrics
    assert (coordinator.run_dir / "dashboard.url").stat().st_mode & 0o077 == 0  # the token is the owner's
    assert sorted(b["name"] for b in state["boards"]) == ["a", "c", "victim"]
    assert len(state["curves"]) >= 3
    by_step = {r["step"]: r for r in written}
    for point in state["curves"]:
        if point["step"] in by_step:
            assert point["loss"] == by_step[point["step"]]["loss"]
    samples = {dict(labels)["board"]: v for (name, labels), v in metrics.items() if name == "edgetrain_board_samples_total"}
    assert set(samples) == {"a", "c", "victim"} and all(v > 0 for v in samples.values())
    assert metrics[("edgetrain_loss", (("job", job.name),))] in {r["loss"] for r in read_metrics(coordinator.run_dir)}
    assert _get(url, "/metrics").status == 401
    # TensorBoard (training.tensorboard: true) got the same losses as metrics.jsonl
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    coordinator.stop.set()
    coordinator.thread.join(60)
    # the page closed with its run: its URL file is gone, and `edgetrain dashboard` says there is none
    assert not (coordinator.run_dir / "dashboard.url").exists()
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        assert edgetrain(["dashboard", "--runs-dir", str(coordinator.run_dir.parent)]) == 1
    assert errors.getvalue().startswith("edgetrain dashboard: no dashboard is being served") and errors.getvalue().count("\n") == 1
    events = EventAccumulator(str(coordinator.run_dir / "tensorboard"))
    events.Reload()
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    written = {r["step"]: r["loss"] for r in read_metrics(coordinator.run_dir)}
    assert losses and set(losses) <= set(written)
    assert all(losses[s] == pytest.approx(written[s], rel=1e-6) for s in losses)
    assert {t.split("/")[0] for t in events.Tags()["scalars"]} >= {"train", "share", "compute_s", "comm_s"}


def test_tensorboard_scalars_are_the_metrics_jsonl_values(tmp_path: Path) -> None:
    # Prepare: a log with TensorBoard on; one step and one evaluation
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from coordinator.training.metrics import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl", tensorboard=tmp_path / "tb", note="SYNTHETIC data")
    log.evaluation(0, loss=2.25, accuracy=0.125, samples=64, seconds=0.5)
    log.evaluation(9, loss=2.0, accuracy=0.25, samples=64, seconds=0.5)
    log.close()

    # Execute: read the event files back with TensorBoard's own reader
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()

    # Assert: the values, and the synthetic-data note
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars == {"test/accuracy": [(0, 0.125), (9, 0.25)], "test/loss": [(0, 2.25), (9, 2.0)]}
    assert "SYNTHETIC" in events.Tensors("run/text_summary")[0].tensor_proto.string_val[0].decode()


def test_a_job_server_dashboard_lists_its_jobs_and_lobby(tmp_path: Path) -> None:
    # Prepare: a real job server (no scheduling loop: the job stays waiting) with one job and one board
    import yaml

    from coordinator.dashboard.server import serve_dashboard
    from coordinator.dashboard.view import JobServerView
    from coordinator.jobs.server import JobServer

    server = JobServer(state_dir=tmp_path / "state", runs_dir=tmp_path / "runs", data_dir=tmp_path / "data",
                       reference_s=0.05)
    record = server.submit(yaml.safe_dump({"name": "queued", "model": "small_cnn",
                                           "dataset": {"name": "synthetic", "train_size": 64, "test_size": 16},
                                           "training": {"global_batch": 8, "steps": 5}, "schedule": {"kind": "hard", "count": 2}}))
    server.join("lobby-1", reference_s=0.1, mbit_per_s=100.0)
    page = serve_dashboard("127.0.0.1:0", JobServerView(server).state, tmp_path / "state" / "dashboard.url", None)
    try:
        url = (tmp_path / "state" / "dashboard.url").read_text().strip()
        # Execute
        state = json.loads(_get(url, "/api/state", bearer=page.token).body)
        metrics = _metrics(_get(url, "/metrics", bearer=page.token).body)
        # Assert
        assert [(j["id"], j["name"], j["state"], j["steps"]) for j in state["jobs"]] == [(record.id, "queued", "waiting", 5)]
        assert [(b["name"], b["state"], b["speed"]) for b in state["boards"]] == [("lobby-1", "ready", 0.5)]
        assert metrics[("edgetrain_board_up", (("board", "lobby-1"), ("job", "job server")))] == 1
        assert _get(url, "/api/state").status == 401
    finally:
        page.close()
        server.shutdown()


def test_a_step_over_other_boards_than_the_last_is_listed_as_a_re_plan(tmp_path: Path) -> None:
    # Prepare: steps over a and b, then over a alone (b left), then over a and c (c joined), then b is back
    shares = [{"a-1": 8, "b-2": 8}, {"a-1": 8, "b-2": 8}, {"a-1": 16}, {"a-1": 8, "c-3": 8},
              {"a-1": 8, "b-2": 4, "c-3": 4}]
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "train", "step": i, "shares": s}) + "\n" for i, s in enumerate(shares)))

    # Execute
    plans = RunView("j", tmp_path, DeviceRegistry(), synthetic=False).state()["plans"]

    # Assert
    assert [(p["step"], p["left"], p["joined"], p["reasons"]) for p in plans] == [
        (2, ["b-2"], [], ["without b-2"]), (3, [], ["c-3"], ["with c-3"]), (4, [], ["b-2"], ["with b-2 again"])]


def test_failed_attempts_and_re_plans_name_boards_by_their_names(tmp_path: Path) -> None:
    # Prepare: two boards; a step where b's attempt was lost, then a step without b
    registry = DeviceRegistry()
    a, b = registry.register("a", {}, {}).device_id, registry.register("b", {}, {}).device_id
    steps = [{"kind": "train", "step": 0, "shares": {a: 8, b: 8}},
             {"kind": "train", "step": 1, "shares": {a: 16}, "failures": [{"attempt": 0, "failed": {b: "gone"}}],
              "attempt_log": [{"attempt": 0, "lost": [b], "outcome": "failed"}]}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))

    # Execute
    state = RunView("j", tmp_path, registry, synthetic=False).state()

    # Assert: names, not device ids, as the fleet table shows them
    assert [f["failed"] for f in state["failures"]] == [{"b": "gone"}]
    assert [(p["step"], p["reasons"]) for p in state["plans"]] == [(1, ["without b"])]


def test_without_the_planner_a_ready_board_the_split_gave_nothing_is_left_out(tmp_path: Path) -> None:
    registry = _registry_with_two_boards()  # a: profiled (ready); b: not yet
    ids = {r.name: r.device_id for r in registry.snapshot()}
    registry.set_profile(ids["b"], BoardProfile(((8, 4.0),), 2**30, 2**29, 2**27))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 0, "step_s": 1.0,
                                                        "shares": {ids["a"]: 16}}) + "\n")
    picture = RunView("j", tmp_path, registry, synthetic=False).state()["plan"]
    assert picture["shards"] == [{"name": "a", "samples": 16}]
    assert picture["left_out"] == {"b": "no samples this step"}


def test_the_plan_picture_is_the_planners_plan_as_the_last_step_ran_it(tmp_path: Path) -> None:
    # Prepare: the planner's record (2 stages, the second a group of two, one DP shard, one board
    # beside the steps, one left out) and a step that ran it
    plan = {"kind": "plan", "step": 0, "reasons": ["first plan"], "switched": True, "predicted_step_s": 2.0,
            "plan": {"stages": [{"blocks": 4, "boards": ["s0"]}, {"blocks": 6, "boards": ["g1", "g2"]}],
                     "microbatches": 4, "schedule": "1f1b", "dp_boards": ["d"], "dp_share": 0.25},
            "left_out": {"w": "no gain"}, "local_boards": ["slow"]}
    trial = {"kind": "plan_trial", "step": 8, "started": 0, "noise_scale": 512.0, "chosen": 1,
             "candidates": [{"plan": "data parallelism over d", "measured_step_s": 3.0, "efficiency": 1.0,
                             "score": 21.3},
                            {"plan": "the pipeline", "measured_step_s": 2.5, "efficiency": 1.0, "score": 25.6}]}
    step = {"kind": "train", "step": 0, "step_s": 2.5, "predicted_step_s": None,  # pipeline steps: the plan's
            "shares": {"s0": 24, "g1": 14, "g2": 10, "d": 8},
            "stages": {"g2": {"stage": 1, "blocks": [4, 10]}, "s0": {"stage": 0, "blocks": [0, 4], "compute_s": 1.0,
                                                                      "wait_s": 0.5},
                       "g1": {"stage": 1, "blocks": [4, 10]}},
            "devices": {"pipeline0": {"compute_s": 1.2}, "d": {"compute_s": 2.0, "comm_s": 0.3, "waiting_s": 0.1,
                                                               "idle_s": 0.1}}}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (plan, trial, step)))

    # Execute
    state = RunView("j", tmp_path, DeviceRegistry(), synthetic=False).state()
    picture = state["plan"]

    # Assert
    assert picture == {
        "kind": "hybrid", "source": "planner", "step": 0, "microbatches": 4, "schedule": "1f1b",
        "stages": [{"stage": 0, "blocks": [0, 4], "boards": [{"name": "s0", "samples": 24}]},
                   {"stage": 1, "blocks": [4, 10], "boards": [{"name": "g1", "samples": 14},
                                                              {"name": "g2", "samples": 10}]}],
        "shards": [{"name": "d", "samples": 8}], "local": ["slow"], "left_out": {"w": "no gain"},
        "predicted_step_s": 2.0, "measured_step_s": 2.5,
        "measured": {"steps": [0, 8], "noise_scale": 512.0, "candidates": [
            {"plan": "data parallelism over d", "measured_step_s": 3.0, "efficiency": 1.0, "score": 21.3,
             "kept": False},
            {"plan": "the pipeline", "measured_step_s": 2.5, "efficiency": 1.0, "score": 25.6, "kept": True}]}}
    # the step timeline has each stage host, not the merged pipeline the aggregation saw
    parts = state["timeline"][-1]["boards"]
    assert sorted(parts) == ["d", "g1", "g2", "s0"]
    assert parts["s0"] == {"compute_s": 1.0, "comm_s": None, "waiting_s": 0.5, "idle_s": 1.0}
    assert parts["d"] == {"compute_s": 2.0, "comm_s": 0.3, "waiting_s": 0.1, "idle_s": 0.1}

    # the same stage as a channel group: each member's share of the channels, the leader's rows
    step["shares"].update(g1=24, g2=0)
    step["stages"]["g1"]["channels"], step["stages"]["g2"]["channels"] = [0.0, 0.6], [0.6, 1.0]
    (tmp_path / "metrics.jsonl").write_text(json.dumps(plan) + "\n" + json.dumps(step) + "\n")
    group = RunView("j", tmp_path, DeviceRegistry(), synthetic=False).state()["plan"]["stages"][1]
    assert group == {"stage": 1, "blocks": [4, 10], "split": "channels",
                     "boards": [{"name": "g1", "samples": 24, "channels": [0.0, 0.6]},
                                {"name": "g2", "samples": 0, "channels": [0.6, 1.0]}]}


def test_a_dashboard_address_that_cannot_serve_is_a_one_line_error(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    from coordinator.dashboard.server import serve_dashboard
    from edgetrain.config import ConfigError

    # a port somebody holds: a clear ConfigError (the CLI prints it in one line), nothing left listening
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--dashboard 127.0.0.1:{port}: cannot listen there"):
            serve_dashboard(f"127.0.0.1:{port}", dict, tmp_path / "dashboard.url", None)
    # an address that is not HOST:PORT: refused by the command line before anything starts
    done = subprocess.run([sys.executable, "-m", "edgetrain", "coordinator", "--insecure", "--dashboard", "8080"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "expected HOST:PORT" in done.stderr and "Traceback" not in done.stderr
