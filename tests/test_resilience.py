"""Faults with real processes: a board killed mid-run, a coordinator killed and restarted while
its boards keep running."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import yaml
from conftest import read_metrics, small_job, spawn_edgetrain, wait_for

from edgetrain.config import job_to_dict

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_killed_board_is_lost_at_once_and_named_in_the_step_record(coordinator_factory, client_factory):
    # Prepare: heartbeats could notice a dead board only after a minute: whatever finds it sooner
    # is its broken connection. The victim is killed right after its first step.
    job = small_job(training={"steps": 10, "min_clients": 3, "global_batch": 96, "step_timeout_s": 120.0,
                              "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 60.0})
    coordinator = coordinator_factory(job)
    client_factory(coordinator.address, "a", 0.6)
    client_factory(coordinator.address, "b", 0.4)
    victim = client_factory(coordinator.address, "victim", 0.3)
    wait_for(lambda: any(any(d.startswith("victim") for d in s["devices"]) for s in read_metrics(coordinator.run_dir)),
             150, "the victim to take part in a step", interval_s=0.02)

    # Execute
    victim.kill()
    summary = coordinator.wait(timeout=200)

    # Assert: dropped for its broken connection (not silence), the step it was in was redone by
    # the others, and the step's record names it as lost in that attempt
    gone = {d["device"]: d for d in summary["devices"]}
    victims = [d for d in gone if d.startswith("victim")]
    assert victims and all(gone[d]["left_reason"] == "its connection to the coordinator broke" for d in victims), gone
    steps = read_metrics(coordinator.run_dir)
    assert [s["step"] for s in steps] == list(range(job.training.steps))
    hit = [s for s in steps if any(d.startswith("victim") for d in s["failed"])]
    assert len(hit) == 1, [s["failed"] for s in steps]
    log = hit[0]["attempt_log"]
    assert log[0]["outcome"] == "redone" and any(d.startswith("victim") for d in log[0]["lost"])
    assert log[-1]["outcome"] == "applied" and not any(d.startswith("victim") for d in log[-1]["boards"])
    assert all(s["attempt_log"][-1]["outcome"] == "applied" for s in steps)


def _free_port_pair() -> int:
    """A port P with P + 1 free too (the fleet port and the pairing port after it)."""
    for _ in range(50):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports")


def _coordinator_process(job_file: Path, port: int, runs_dir: Path, log: Path,
                         extra: tuple[str, ...] = ("--no-advertise",)):
    """`edgetrain coordinator` as its own process on 127.0.0.1:`port`, under the session's authority."""
    args = ["coordinator", "--config", str(job_file), "--bind", f"127.0.0.1:{port}", "--runs-dir", str(runs_dir),
            "--data-dir", str(runs_dir / "data"), *extra]
    return spawn_edgetrain(args, log, f"coordinator-{runs_dir.name}")


@pytest.mark.timeout(300)
def test_boards_outlive_a_killed_coordinator_and_rejoin_the_restarted_one(tmp_path, client_factory):
    # Prepare: a coordinator process with a job that outlasts the test, two boards that know its
    # address only; both train
    job = small_job(training={"steps": 100_000, "min_clients": 2, "global_batch": 32})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job_to_dict(job)))
    port = _free_port_pair()
    first = _coordinator_process(job_file, port, tmp_path / "first", tmp_path / "first.log")
    try:
        boards = [client_factory(f"127.0.0.1:{port}", name, 0.5) for name in ("p", "q")]
        first_run = tmp_path / "first" / job.name
        wait_for(lambda: len(read_metrics(first_run)) >= 2, 150, "two steps on the first coordinator")

        # Execute: kill it; once both boards have noticed, a new one starts on the same address
        first.kill()
        first.wait(10)
        logs = [tmp_path / f"{name}.log" for name in ("p", "q")]
        wait_for(lambda: all("lost the coordinator" in log.read_text() for log in logs), 60,
                 "both boards to notice the coordinator is gone")
        second = _coordinator_process(job_file, port, tmp_path / "second", tmp_path / "second.log")
        try:
            second_run = tmp_path / "second" / job.name
            # Assert: with nobody touching them, both boards register again and train
            steps = wait_for(lambda: [s for s in read_metrics(second_run) if len(s["devices"]) == 2], 150,
                             "a step on the restarted coordinator with both boards")
            assert {d.split("-")[0] for d in steps[0]["devices"]} == {"p", "q"}
            assert all(board.poll() is None for board in boards)
            for log in logs:
                text = log.read_text()
                assert "coordinator reached at" in text and "Traceback" not in text
        finally:
            second.kill()
    finally:
        first.kill()


@pytest.mark.timeout(300)
def test_board_finds_a_coordinator_that_came_back_on_another_address_over_mdns(tmp_path):
    # Prepare: a coordinator advertising a cluster of its own on loopback; a board that knows no
    # address (it finds the coordinator over mDNS, pairs, trains)
    cluster = f"resilience-{os.getpid()}"
    job = small_job(training={"steps": 100_000, "min_clients": 1, "global_batch": 16})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job_to_dict(job)))
    mdns = ("--cluster", cluster, "--advertise", "127.0.0.1")
    first = _coordinator_process(job_file, _free_port_pair(), tmp_path / "first", tmp_path / "first.log", extra=mdns)
    board_log = tmp_path / "board.log"
    board = spawn_edgetrain(["client", "--name", "roamer", "--threads", "1", "--cluster", cluster,
                             "--interface", "127.0.0.1"], board_log, "roamer")
    second = None
    try:
        wait_for(lambda: len(read_metrics(tmp_path / "first" / job.name)) >= 1, 150, "a step on the first coordinator")

        # Execute: the coordinator dies and comes back on another port
        first.kill()
        first.wait(10)
        wait_for(lambda: "lost the coordinator" in board_log.read_text(), 60, "the board to notice")
        second = _coordinator_process(job_file, _free_port_pair(), tmp_path / "second", tmp_path / "second.log",
                                      extra=mdns)

        # Assert: the board found it over mDNS and trains there, nobody touching it
        wait_for(lambda: read_metrics(tmp_path / "second" / job.name), 150, "a step on the second coordinator")
        assert board.poll() is None
        text = board_log.read_text()
        assert "coordinator reached at" in text and "Traceback" not in text
    finally:
        for process in (first, second, board):
            if process is not None:
                process.kill()
