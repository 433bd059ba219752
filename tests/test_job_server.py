"""The job server: several jobs share a fleet of real client processes; bad requests; restarts.

Job servers here serve as users run them: mutual TLS under the session's fleet authority
(conftest), boards pairing with its join token; users call with the gateway's operator credential.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import psutil
import pytest
import yaml
from conftest import board_channel, board_identity, small_job, wait_for

import edgetrain
from coordinator.jobs.command import is_job_server
from coordinator.jobs.lobby import FAR_OFF
from coordinator.jobs.scheduler import Board, Job
from coordinator.jobs.server import JobServer
from coordinator.jobs.servicer import JobServerServicer
from coordinator.jobs.speed import PlannerSpeed, board_spec
from coordinator.pairing import serve_gateway
from edgetrain import transport, trust
from edgetrain.cli import main
from edgetrain.config import job_from_dict
from edgetrain.emulator.job_simulator import simulate
from protos import jobs_pb2 as pb
from protos import jobs_pb2_grpc as pb_grpc


def job_yaml(name: str, steps: int, schedule: dict, model: str = "small_cnn", batch: int = 16,
             **training) -> str:
    return yaml.safe_dump({
        "name": name, "model": model,
        "dataset": {"name": "synthetic", "train_size": 512, "test_size": 64, "augment": False},
        "training": {"global_batch": batch, "steps": steps, "eval_every": 0, "log_every": 1,
                     "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 8.0, **training},
        "schedule": schedule,
    })


def session_authority() -> trust.Authority:
    """The session's fleet authority (conftest's fleet_authority, in $EDGETRAIN_HOME)."""
    return trust.Authority(trust.default_authority_dir())


def operator_security() -> transport.MutualTLS:
    """What `edgetrain submit | jobs | cancel` on the gateway dial with: its operator credential."""
    return session_authority().operator_identity().security(trust.GATEWAY_SERVER_NAME)


def operator_stub(address: str) -> tuple[grpc.Channel, pb_grpc.JobServerStub]:
    channel = transport.open_channel(address, operator_security())
    return channel, pb_grpc.JobServerStub(channel)


class InProcessServer:
    """A JobServer with its gRPC face in this process, served as `serve_jobs` serves it: mutual
    TLS under `authority` (default: the session's) on 127.0.0.1:0 and pairing on the next port,
    or plaintext with `authority` None. No boards; `stub` calls as the gateway's operator."""

    def __init__(self, state_dir: Path, *, authority: trust.Authority | None | str = "session") -> None:
        self.authority = session_authority() if authority == "session" else authority
        self.server = JobServer(state_dir=state_dir, runs_dir=state_dir / "runs", data_dir=state_dir / "data",
                                reference_s=0.05, authority=self.authority)
        self.servers = serve_gateway("127.0.0.1:0", [(pb_grpc.add_JobServerServicer_to_server,
                                                      JobServerServicer(self.server))], authority=self.authority)
        self.port = self.servers.port
        self.address = f"127.0.0.1:{self.port}"
        self.stop = threading.Event()
        self.loop = threading.Thread(target=self.server.run, args=(self.stop,), daemon=True)
        self.loop.start()
        self.channels: list[grpc.Channel] = []
        self.stub = self.stub_as(operator_security() if self.authority else transport.INSECURE)

    def stub_as(self, security: transport.Security) -> pb_grpc.JobServerStub:
        """A stub dialing with `security` (closed with the server)."""
        self.channels.append(transport.open_channel(self.address, security))
        return pb_grpc.JobServerStub(self.channels[-1])

    def board(self, name: str) -> pb_grpc.JobServerStub:
        """A stub calling as board `name` (a certificate for it from the session's authority)."""
        if self.authority is None:
            return self.stub_as(transport.INSECURE)
        return self.stub_as(board_identity(name).security(trust.GATEWAY_SERVER_NAME))

    def close(self) -> None:
        if self.stop.is_set():
            return
        self.stop.set()
        self.loop.join(5)
        for channel in self.channels:
            channel.close()
        self.servers.stop(0)
        self.server.shutdown()


@pytest.fixture
def in_process(tmp_path):
    servers = []

    def start(**kw):
        servers.append(InProcessServer(tmp_path / "state", **kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_bad_requests_get_precise_status_and_the_server_keeps_serving(in_process):
    server = in_process()
    stub, board = server.stub, server.board("b")
    cases = [
        (lambda: stub.Submit(pb.SubmitRequest(job_yaml="name: [unclosed")), grpc.StatusCode.INVALID_ARGUMENT,
         "not valid YAML"),
        (lambda: stub.Submit(pb.SubmitRequest(job_yaml="name: x\nbogus: 1\n")), grpc.StatusCode.INVALID_ARGUMENT,
         "bogus"),
        (lambda: stub.Submit(pb.SubmitRequest(job_yaml=job_yaml("x", 5, {"kind": "hard"}))),
         grpc.StatusCode.INVALID_ARGUMENT, "exactly one of boards"),
        (lambda: stub.Submit(pb.SubmitRequest(job_yaml=job_yaml("x", 5, {"kind": "soft", "min_boards": 3,
                                                                         "max_boards": 2}))),
         grpc.StatusCode.INVALID_ARGUMENT, "max_boards"),
        (lambda: stub.Submit(pb.SubmitRequest(job_yaml="x" * 300_000)), grpc.StatusCode.INVALID_ARGUMENT, "limit"),
        (lambda: stub.Cancel(pb.CancelRequest(id="j99")), grpc.StatusCode.NOT_FOUND, "j99"),
        (lambda: server.board("ghost").NextJob(pb.NextJobRequest(name="ghost", max_wait_s=0)),
         grpc.StatusCode.NOT_FOUND, "ghost"),
        (lambda: board.Join(pb.JoinRequest(name="b", reference_s=-1, protocol_version=edgetrain.PROTOCOL_VERSION)),
         grpc.StatusCode.INVALID_ARGUMENT, "reference_s"),
        (lambda: board.Join(pb.JoinRequest(name="b", reference_s=float("nan"),
                                           protocol_version=edgetrain.PROTOCOL_VERSION)),
         grpc.StatusCode.INVALID_ARGUMENT, "reference_s"),
        (lambda: board.Join(pb.JoinRequest(name="b", reference_s=0.1, link_mbit_per_s=float("inf"),
                                           protocol_version=edgetrain.PROTOCOL_VERSION)),
         grpc.StatusCode.INVALID_ARGUMENT, "link_mbit_per_s"),
        (lambda: board.Join(pb.JoinRequest(name="b", reference_s=0.1, protocol_version=999)),
         grpc.StatusCode.FAILED_PRECONDITION, "protocol version"),
    ]
    for call, code, words in cases:
        got, details = _code(call)
        assert got == code, details
        assert words in details
    listing = stub.ListJobs(pb.ListJobsRequest())
    assert list(listing.jobs) == [] and list(listing.boards) == []  # nothing half-added
    view = stub.Submit(pb.SubmitRequest(job_yaml=job_yaml("ok", 5, {"kind": "soft"})))
    assert (view.id, view.state) == ("j1", "waiting")
    stub.Cancel(pb.CancelRequest(id="j1"))
    got, details = _code(lambda: stub.Cancel(pb.CancelRequest(id="j1")))
    assert got == grpc.StatusCode.FAILED_PRECONDITION and "cancelled" in details


def test_the_jobs_command_tells_a_job_server_from_a_lone_coordinator(in_process, coordinator_factory):
    server, lone = in_process(), coordinator_factory(small_job())

    assert is_job_server(server.address, security=operator_security())
    assert not is_job_server(lone.address, security=operator_security())
    assert not is_job_server("127.0.0.1:1", budget_s=0.5, security=operator_security())  # nothing answers there
    assert not is_job_server(server.address, budget_s=0.5)  # plaintext gets no answer from a TLS server


def test_jobs_survive_a_restart_of_the_job_server(in_process):
    first = in_process()
    for name in ("a", "b", "c"):
        first.stub.Submit(pb.SubmitRequest(job_yaml=job_yaml(name, 5, {"kind": "hard", "count": 2})))
    first.stub.Cancel(pb.CancelRequest(id="j2"))
    first.close()
    second = in_process()
    jobs = {j.id: j for j in second.stub.ListJobs(pb.ListJobsRequest()).jobs}
    assert {k: (j.name, j.state, j.request) for k, j in jobs.items()} == {
        "j1": ("a", "waiting", "2 boards"), "j2": ("b", "cancelled", "2 boards"), "j3": ("c", "waiting", "2 boards")}
    assert second.stub.Submit(pb.SubmitRequest(job_yaml=job_yaml("d", 5, {"kind": "soft"}))).id == "j4"


def test_a_retried_submit_queues_its_job_once_even_across_a_restart(in_process):
    # Prepare
    first = in_process()
    a, b = job_yaml("a", 5, {"kind": "soft"}), job_yaml("b", 5, {"kind": "soft"})
    # Execute: the same key twice, then another key; then the same key after a restart
    once = first.stub.Submit(pb.SubmitRequest(job_yaml=a, idempotency_key="k1"))
    again = first.stub.Submit(pb.SubmitRequest(job_yaml=a, idempotency_key="k1"))
    other = first.stub.Submit(pb.SubmitRequest(job_yaml=a, idempotency_key="k2"))
    first.close()
    second = in_process()
    after_restart = second.stub.Submit(pb.SubmitRequest(job_yaml=a, idempotency_key="k1"))
    got, details = _code(lambda: second.stub.Submit(pb.SubmitRequest(job_yaml=b, idempotency_key="k1")))
    # Assert
    assert (once.id, again.id, other.id, after_restart.id) == ("j1", "j1", "j2", "j1")
    assert [j.id for j in second.stub.ListJobs(pb.ListJobsRequest()).jobs] == ["j1", "j2"]
    assert got == grpc.StatusCode.ALREADY_EXISTS
    assert details == "Submit: idempotency key 'k1' already queued job j1 with a different job YAML"


def test_a_corrupt_jobs_file_is_a_clear_error(tmp_path):
    from coordinator.jobs.store import StoreError

    (tmp_path / "jobs.json").write_text("{not json")
    with pytest.raises(StoreError, match="jobs.json"):
        JobServer(state_dir=tmp_path, runs_dir=tmp_path, data_dir=tmp_path, reference_s=0.05)


# --- the emulated fleet -------------------------------------------------------------------------


def _cli(*args: str) -> str:
    """`edgetrain ARGS` in this process (the same entry point; no second torch import)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    assert code == 0, err.getvalue()
    return out.getvalue()


def _fleet_address(port_file: Path) -> str:
    """Line 1 of a server's port file ("" until it serves); line 2 is its pairing address."""
    lines = port_file.read_text().splitlines() if port_file.exists() else []
    return lines[0].strip() if lines else ""


@pytest.fixture
def job_server(tmp_path, client_factory):
    """`edgetrain coordinator --jobs` as a process, and three client processes at 0.3 of a core."""
    port_file = tmp_path / "server.address"
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "edgetrain", "coordinator", "--jobs", "--bind", "127.0.0.1:0",
                             "--port-file", str(port_file), "--state-dir", str(tmp_path / "state"),
                             "--runs-dir", str(tmp_path / "runs"), "--data-dir", str(tmp_path / "data"),
                             "--no-advertise"], stdout=log, stderr=subprocess.STDOUT)
    address = wait_for(lambda: _fleet_address(port_file), 120, "the job server")
    assert port_file.read_text().splitlines()[1] == f"127.0.0.1:{int(address.rsplit(':', 1)[1]) + 1}"  # pairing
    for i in range(3):
        client_factory(address, f"b{i}", speed=0.3)
    channel, stub = operator_stub(address)
    wait_for(lambda: len(stub.ListJobs(pb.ListJobsRequest()).boards) == 3, 120, "three boards in the lobby")
    yield address, stub, tmp_path
    channel.close()
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()  # a clean stop (SIGTERM) waits for the boards' long polls to end; nothing is left to check
    proc.wait(30)
    for child in children:  # job coordinators it started
        if child.is_running():
            child.kill()
    log.close()


SHARED_BATCH = 8
"""Global batch of the jobs sharing the fleet: a MobileNetV2 step of 8 takes ~0.8 s at 0.3 of a core."""


def test_jobs_share_the_fleet_in_the_order_and_placement_the_simulator_predicts(job_server):
    address, stub, tmp = job_server
    specs = {"a": (6, {"kind": "hard", "boards": ["b0", "b1"]}), "b": (24, {"kind": "hard", "boards": ["b2"]}),
             "c": (6, {"kind": "soft", "min_boards": 1, "max_boards": 2})}
    for name, (steps, schedule) in specs.items():
        (tmp / f"{name}.yaml").write_text(job_yaml(name, steps, schedule, model="mobilenet_v2", batch=SHARED_BATCH))
    # all three go in back to back, through the server's API: a CLI call took up to 24 s on a loaded
    # machine, and the simulator replays the arrivals, so a late c would meet a fleet that the
    # predictions had already emptied (the CLI's submit is tested below)
    for name in ("a", "b", "c"):
        stub.Submit(pb.SubmitRequest(job_yaml=(tmp / f"{name}.yaml").read_text()), timeout=30)

    def all_done():
        jobs = stub.ListJobs(pb.ListJobsRequest()).jobs
        return jobs if all(j.state in ("finished", "failed", "cancelled") for j in jobs) else None

    jobs = {j.name: j for j in wait_for(all_done, 400, "every job to finish")}
    assert {n: j.state for n, j in jobs.items()} == {"a": "finished", "b": "finished", "c": "finished"}, \
        {n: j.message for n, j in jobs.items()}
    assert all(j.steps_done == j.steps for j in jobs.values())
    for j in jobs.values():
        assert (Path(j.run_dir) / "summary.json").exists()
    a, b, c = jobs["a"], jobs["b"], jobs["c"]
    # a and b trained at the same time on disjoint boards; c waited for boards to come free
    assert set(a.boards).isdisjoint(b.boards)
    assert max(a.started, b.started) < min(a.finished, b.finished)
    assert c.started >= a.finished - 1.0
    text = _cli("jobs", "--server", address)
    assert "finished" in text and "b0" in text

    # the simulator, with the same scheduler and the planner's predictions, gives the same schedule
    listing = stub.ListJobs(pb.ListJobsRequest())
    # the speeds the live decisions were made with: the boards' claims (b2's job may since have measured it)
    boards = {bv.name: board_spec(bv.name, bv.claimed_speed, bv.link_mbit_per_s) for bv in listing.boards}
    configs, trace = {}, []
    for j in sorted(listing.jobs, key=lambda j: j.submitted):
        config = job_from_dict(yaml.safe_load(job_yaml(j.name, j.steps, specs[j.name][1], model="mobilenet_v2",
                                                       batch=SHARED_BATCH)))
        configs[j.id] = config
        s = config.schedule
        trace.append(Job(id=j.id, arrival=j.submitted, kind=s.kind, model=j.model, work=float(j.steps * SHARED_BATCH),
                         boards=frozenset(s.boards) if s.boards else None, count=s.count or None,
                         min_boards=s.min_boards, max_boards=s.max_boards or 3, overhead_s=20.0))
    fleet = tuple(Board(bv.name, f"{bv.claimed_speed:.2f}@{bv.link_mbit_per_s:.0f}")
                  for bv in sorted(listing.boards, key=lambda bv: bv.name))
    result = simulate(tuple(trace), fleet, PlannerSpeed(configs, boards), "rolling")
    simulated = sorted(result.records, key=lambda r: r.start)
    live = sorted(listing.jobs, key=lambda j: j.started)
    assert [r.job.id for r in simulated] == [j.id for j in live]
    assert {r.job.id: sorted(r.boards) for r in simulated} == {j.id: sorted(j.boards) for j in live}
    decisions = [json.loads(line) for line in (tmp / "state" / "decisions.jsonl").read_text().splitlines()]
    assert [d["launch"] for d in decisions if d["launch"]] == [["j1"], ["j2"], ["j3"]]


def test_cancelling_a_running_job_returns_its_boards_to_the_lobby(job_server):
    address, stub, tmp = job_server
    (tmp / "long.yaml").write_text(job_yaml("long", 2000, {"kind": "hard", "boards": ["b1"]}))
    _cli("submit", str(tmp / "long.yaml"), "--server", address)
    wait_for(lambda: stub.ListJobs(pb.ListJobsRequest()).jobs[0].steps_done >= 1, 180, "the job to train",
             interval_s=0.2)
    assert "cancelled" in _cli("cancel", "j1", "--server", address)
    job = stub.ListJobs(pb.ListJobsRequest()).jobs[0]
    assert job.state == "cancelled" and 0 < job.steps_done < 2000
    # the board comes back and takes the next job
    (tmp / "next.yaml").write_text(job_yaml("next", 3, {"kind": "hard", "boards": ["b1"]}))
    _cli("submit", str(tmp / "next.yaml"), "--server", address)
    wait_for(lambda: stub.ListJobs(pb.ListJobsRequest()).jobs[1].state == "finished", 180, "the next job on b1",
             interval_s=0.2)


def test_a_board_whose_steps_contradict_its_claimed_speed_is_flagged_and_planned_by_them(job_server):
    address, stub, tmp = job_server
    honest = {b.name: b for b in stub.ListJobs(pb.ListJobsRequest()).boards}
    # b2's client joined with what it measured; under b2's own certificate, a second connection claims
    # it runs the reference workload in 1 µs: about 10^5 times faster than it does
    with board_channel(address, "b2") as channel:
        pb_grpc.JobServerStub(channel).Join(pb.JoinRequest(
            name="b2", reference_s=1e-6, link_mbit_per_s=honest["b2"].link_mbit_per_s,
            protocol_version=edgetrain.PROTOCOL_VERSION), timeout=30)
    claimed = {b.name: b for b in stub.ListJobs(pb.ListJobsRequest()).boards}["b2"]
    assert claimed.claimed_speed > 1000 * honest["b2"].claimed_speed and claimed.flag == ""  # not measured yet
    for board in ("b0", "b1", "b2"):  # each board alone: its steps are its own
        (tmp / f"on-{board}.yaml").write_text(job_yaml(f"on-{board}", 6, {"kind": "hard", "boards": [board]},
                                                       model="mobilenet_v2", batch=SHARED_BATCH))
        _cli("submit", str(tmp / f"on-{board}.yaml"), "--server", address)

    def judged():
        boards = {b.name: b for b in stub.ListJobs(pb.ListJobsRequest()).boards}
        return boards if all(b.measured_speed for b in boards.values()) else None

    boards = wait_for(judged, 300, "every board measured by its job", interval_s=0.5)
    jobs = {j.name: j for j in stub.ListJobs(pb.ListJobsRequest()).jobs}
    b2 = boards["b2"]
    assert b2.flag.startswith("claims") and f"job {jobs['on-b2'].id}" in b2.flag, b2
    assert b2.speed == b2.measured_speed  # planned by what its steps measured, not by its claim
    # ... which is about what it really is, in the terms of the others' claims
    assert honest["b2"].claimed_speed / FAR_OFF <= b2.measured_speed <= honest["b2"].claimed_speed * FAR_OFF, b2
    for name in ("b0", "b1"):  # an honest claim agrees with its steps
        assert boards[name].flag == "" and boards[name].speed == boards[name].claimed_speed, boards[name]
    assert jobs["on-b2"].measured_samples_per_s > 0
    assert "flagged: b2 claims" in _cli("jobs", "--server", address)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _page_state(url: str) -> dict:
    """A dashboard's snapshot, read with the token its printed URL carries."""
    import urllib.request

    with urllib.request.urlopen(url.replace("/?token=", "/api/state?token="), timeout=10) as response:
        return json.loads(response.read())


def test_a_killed_job_server_adopts_its_running_job_when_it_comes_back(tmp_path, client_factory):
    port = _free_port()
    address = f"127.0.0.1:{port}"
    logs = []

    def start_server() -> subprocess.Popen:
        logs.append((tmp_path / f"server{len(logs)}.log").open("w"))
        return subprocess.Popen([sys.executable, "-m", "edgetrain", "coordinator", "--jobs", "--bind", address,
                                 "--state-dir", str(tmp_path / "state"), "--runs-dir", str(tmp_path / "runs"),
                                 "--data-dir", str(tmp_path / "data"), "--no-advertise", "--dashboard",
                                 "127.0.0.1:0" if not logs[:-1] else "none"],
                                stdout=logs[-1], stderr=subprocess.STDOUT)

    server = start_server()
    coordinators, boards = [], []
    try:
        boards = [client_factory(address, f"b{i}", speed=0.3) for i in range(2)]
        channel, stub = operator_stub(address)
        wait_for(lambda: len(getattr(_listing(stub), "boards", ())) == 2, 120, "two boards")
        # b0 will be held still (SIGSTOP) while the job server is down: the job must not give it up
        stub.Submit(pb.SubmitRequest(job_yaml=job_yaml("long", 60, {"kind": "hard", "boards": ["b0"]},
                                                       heartbeat_timeout_s=600.0,
                                                       step_timeout_s=600.0)))
        wait_for(lambda: stub.ListJobs(pb.ListJobsRequest()).jobs[0].steps_done >= 3, 180, "the job to train",
                 interval_s=0.1)
        # the job server's dashboard lists the job with a link to its coordinator's own page, which
        # shows the run's steps on the board the job server gave it
        page = (tmp_path / "state" / "dashboard.url").read_text().strip()
        listed = _page_state(page)["jobs"]
        assert [(j["id"], j["state"], j["boards"]) for j in listed] == [("j1", "running", ["b0"])]
        run_page = _page_state(listed[0]["dashboard"])
        assert run_page["job"] == "j1-long" and run_page["curves"]
        assert [b["name"] for b in run_page["boards"]] == ["b0"]
        os.kill(boards[0].pid, signal.SIGSTOP)  # the job stays mid-run however long the restart takes
        coordinators = psutil.Process(server.pid).children(recursive=True)
        assert len(coordinators) == 1
        server.kill()  # no clean shutdown: the job's coordinator and its board go on without it
        server.wait(10)
        assert coordinators[0].is_running()
        server = start_server()
        job = wait_for(lambda: _listing(stub), 120, "the restarted job server").jobs[0]
        assert (job.id, job.state) == ("j1", "running")  # adopted, not restarted
        assert 3 <= job.steps_done < 60
        os.kill(boards[0].pid, signal.SIGCONT)
        stub.Submit(pb.SubmitRequest(job_yaml=job_yaml("other", 3, {"kind": "hard", "boards": ["b1"]})))
        jobs = wait_for(lambda: [j for j in stub.ListJobs(pb.ListJobsRequest()).jobs if j.state == "finished"]
                     if all(j.state == "finished" for j in stub.ListJobs(pb.ListJobsRequest()).jobs) else None,
                     300, "both jobs to finish", interval_s=0.2)
        assert [(j.id, j.steps_done) for j in jobs] == [("j1", 60), ("j2", 3)]
        run = [json.loads(line) for line in (tmp_path / "runs" / "j1-long" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in run if r["kind"] == "train"] == list(range(60))  # one run, no step redone
        # b0 came back to the lobby after its job and joined again
        wait_for(lambda: {b.name: b.job for b in stub.ListJobs(pb.ListJobsRequest()).boards}.get("b0") == "", 60,
              "b0 back in the lobby", interval_s=0.2)
        channel.close()
    finally:
        for board in boards:
            with contextlib.suppress(ProcessLookupError):
                os.kill(board.pid, signal.SIGCONT)
        server.kill()
        server.wait(30)
        for proc in coordinators:
            if proc.is_running():
                proc.kill()
        for log in logs:
            log.close()


def _listing(stub):
    try:
        return stub.ListJobs(pb.ListJobsRequest(), timeout=5)
    except grpc.RpcError:
        return None


def test_a_job_whose_board_never_joins_is_stopped_and_queued_again(in_process, monkeypatch):
    import coordinator.jobs.server as job_server_module

    monkeypatch.setattr(job_server_module, "FIRST_STEP_TIMEOUT_S", 3.0)
    server = in_process()
    stub, silent = server.stub, server.board("silent")
    silent.Join(pb.JoinRequest(name="silent", reference_s=0.1, protocol_version=edgetrain.PROTOCOL_VERSION))
    stub.Submit(pb.SubmitRequest(job_yaml=job_yaml("stuck", 5, {"kind": "hard", "boards": ["silent"]})))
    offer = silent.NextJob(pb.NextJobRequest(name="silent", max_wait_s=30), timeout=200)
    assert offer.job_id == "j1" and offer.port > 0  # offered, but this board never goes there
    first_pid = server.server.store.jobs["j1"].pid

    job = wait_for(lambda: (j := stub.ListJobs(pb.ListJobsRequest()).jobs[0]).state == "waiting" and j, 60,
                "the stalled job to be queued again")
    assert "silent" in job.message and job.boards == []  # the board must show up in the lobby first
    silent.NextJob(pb.NextJobRequest(name="silent", max_wait_s=0))
    wait_for(lambda: stub.ListJobs(pb.ListJobsRequest()).jobs[0].launches == 2, 60, "a second launch")
    wait_for(lambda: not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() == psutil.STATUS_ZOMBIE,
          30, "its coordinator to stop")
