"""A lab's own images, end to end: imported on the gateway and served to boards, or kept on the
board that took them (`edgetrain client --local-data`), with a real coordinator and client
processes.

The images are generated here: colour-coded classes (each class its own hue, with texture noise
and a random size), written as PNG and JPEG files of several sizes.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import board_identity, read_metrics, small_job, spawn_client, wait_for
from reference import checkpoint_state, max_abs_difference

from edge_client.local_data import LocalData
from edgetrain.cli import main
from edgetrain.data import dataset_classes, load_dataset, make_batch, normalize
from edgetrain.image_folder import write_image_folder
from edgetrain.models import build_model
from edgetrain.sampling import board_seed, indices_from
from edgetrain.training import make_optimizer, set_learning_rate

pytestmark = pytest.mark.slow

CLASSES = ("amber", "blue", "green", "violet")
HUES = np.array([[220, 140, 20], [30, 60, 220], [30, 200, 60], [160, 40, 200]])
TOLERANCE = 2e-5
"""float32: the sample-weighted mean of the boards' gradients against the gradient of the joined
batch differ only in rounding (as in tests/test_dp_integration.py)."""


def colour_images(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` uint8 (3, 40, 40) images whose class is their hue, under strong pixel noise."""
    rng = np.random.default_rng(seed)
    labels = np.arange(count) % len(CLASSES)
    noise = rng.integers(-70, 71, (count, 3, 40, 40))
    images = np.clip(HUES[labels][:, :, None, None] + noise, 0, 255).astype(np.uint8)
    return images, labels


def image_folder(root: Path, count: int, seed: int, classes=CLASSES) -> Path:
    """An image folder of `count` colour-coded images, half PNG at 40x40, half JPEG at 64x64."""
    images, labels = colour_images(count, seed)
    half = count // 2
    write_image_folder(root, images[:half], labels[:half], classes, fmt="png")
    write_image_folder(root, images[half:], labels[half:], classes, fmt="jpeg", side=64,
                       stems=range(half, count))
    return root


def import_gateway_set(tmp_path: Path, capsys) -> Path:
    """The gateway's own set, imported under ./data as "lab" (train/ and test/ folders)."""
    source = tmp_path / "gateway-images"
    image_folder(source / "train", 480, seed=1)
    image_folder(source / "test", 120, seed=2)
    assert main(["data", "import", "imagefolder", str(source), "--name", "lab", "--data-dir", "data",
                 "--block-samples", "100"]) == 0
    capsys.readouterr()
    return Path("data").resolve()


def own_job(**sections):
    base = {"dataset": {"name": "lab", "train_size": None, "test_size": None, "augment": False}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return small_job(**base)


@pytest.mark.timeout(240)
def test_an_imported_image_folder_trains_to_high_accuracy_from_served_blocks(tmp_path, monkeypatch, capsys,
                                                                            coordinator_factory, client_factory):
    # Prepare: the folder imported on the gateway; the boards have no copy: they fetch its blocks
    monkeypatch.chdir(tmp_path)
    import_gateway_set(tmp_path, capsys)
    job = own_job(training={"steps": 40, "min_clients": 2, "global_batch": 32, "eval_every": 20},
                  optimizer={"lr": 0.05, "momentum": 0.9, "schedule": "constant", "warmup_steps": 0})
    coordinator = coordinator_factory(job)
    for name, speed in (("cam-1", 0.5), ("cam-2", 0.3)):
        client_factory(coordinator.address, name, speed, extra=("--data-dir", str(tmp_path / name)))

    # Execute
    summary = coordinator.wait(timeout=200)

    # Assert: a 4-class model, trained from blocks fetched and cached on the boards
    assert summary["classes"] == 4 and summary["dataset"] == "lab" and not summary["synthetic_data"]
    assert summary["test_accuracy"] >= 0.9, summary["test_accuracy"]
    for name in ("cam-1", "cam-2"):
        assert list((tmp_path / name / "lab-blocks").glob("*.block"))
        assert "fetched block" in (tmp_path / f"{name}.log").read_text()
    assert "chance 0.250" in capsys.readouterr().out


def reference_with_own_data(job, steps: list[dict], datasets: dict[str, object]) -> dict[str, torch.Tensor]:
    """Single-process SGD on the joined batches each step's boards trained on, each board's
    samples taken from its own order (`datasets`: board name -> its own samples)."""
    model = build_model(job.model, num_classes=len(CLASSES), seed=job.seed)
    optimizer = make_optimizer(model, job.optimizer)
    cursors: dict[str, int] = {}
    model.train()
    for record in steps:
        xs, ys = [], []
        for device, count in sorted(record["shares"].items()):
            name = device.rsplit("-", 1)[0]
            dataset = datasets[name]
            indices = indices_from(cursors.get(name, 0), count, len(dataset), board_seed(job.seed, name))
            cursors[name] = cursors.get(name, 0) + count
            x, y = make_batch(dataset, indices, augment=False, seed=job.seed, step=record["step"])
            xs.append(x)
            ys.append(y)
        set_learning_rate(optimizer, record["step"], job.training.steps, job.optimizer)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.timeout(240)
def test_boards_train_on_their_own_images_weighted_by_the_samples_they_used(tmp_path, monkeypatch, capsys,
                                                                           coordinator_factory, client_factory):
    # Prepare: two boards, each with a disjoint folder of its own (one holds two classes only,
    # and fewer images than a step asks of it); a BN-free model, so the step is exact arithmetic
    monkeypatch.chdir(tmp_path)
    import_gateway_set(tmp_path, capsys)
    folders = {"own-a": image_folder(tmp_path / "own-a", 96, seed=11),
               "own-b": image_folder(tmp_path / "own-b", 20, seed=12, classes=("green", "amber", "blue", "violet"))}
    for stray in ("blue", "violet"):  # own-b: two classes only
        for path in (folders["own-b"] / stray).iterdir():
            path.unlink()
        (folders["own-b"] / stray).rmdir()
    job = own_job(training={"steps": 5, "min_clients": 2, "global_batch": 48, "split": "equal"})
    coordinator = coordinator_factory(job)
    for name, folder in folders.items():
        client_factory(coordinator.address, name, 0.4, extra=("--local-data", str(folder),
                                                             "--data-dir", str(tmp_path / f"{name}-data")))

    # Execute
    summary = coordinator.wait(timeout=200)

    # Assert: every step trained 24 samples on each board, from its own images, and the model is
    # single-process SGD on the joined batches (each board's gradient weighted by its samples)
    steps = read_metrics(coordinator.run_dir)
    assert [sorted(s["shares"].values()) for s in steps] == [[24, 24]] * job.training.steps
    classes = dataset_classes(job.dataset)
    datasets = {name: LocalData(folder, tmp_path / "reference").prepare().for_job(classes)
                for name, folder in folders.items()}
    diff = max_abs_difference(checkpoint_state(coordinator.run_dir), reference_with_own_data(job, steps, datasets))
    assert diff < TOLERANCE, f"distributed and reference parameters differ by {diff}"
    # what the boards said of their data: counts, by class name; no board fetched a block
    own = {row["device"].rsplit("-", 1)[0]: row["own_data"] for row in summary["devices"]}
    assert own["own-a"] == {"samples": 96, "class_counts": {c: 24 for c in CLASSES}}
    assert own["own-b"] == {"samples": 10, "class_counts": {"amber": 5, "green": 5}}
    for name in folders:
        log = (tmp_path / f"{name}.log").read_text()
        assert "trains on its own" in log and "fetched block" not in log
        assert not (tmp_path / f"{name}-data" / "lab-blocks").exists()
    assert "own data, 10 samples: amber 5, green 5" in capsys.readouterr().out


class RecordingProxy:
    """A TCP relay on 127.0.0.1 to `upstream` that keeps every byte its clients send."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.sent = bytearray()
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:  # the coordinator is gone (the test is ending): the board's dial fails as it would
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, record: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if record:
                    with self._lock:
                        self.sent += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._server.close()


def insecure_coordinator(job, tmp_path: Path):
    """A coordinator serving `job` in plaintext (--insecure), so its boards' bytes can be read."""
    from coordinator.main import run_coordinator

    port_file, stop, result = tmp_path / "insecure.address", threading.Event(), {}

    def serve() -> None:
        try:
            result["summary"] = run_coordinator(job, bind="127.0.0.1:0", runs_dir=str(tmp_path / "runs"),
                                                port_file=str(port_file), stop=stop, data_dir="data")
        except BaseException as e:  # noqa: BLE001 - reported by the test
            result["error"] = e

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    wait_for(lambda: port_file.exists() and port_file.read_text().strip(), 60, "the coordinator's address")
    return port_file.read_text().splitlines()[0].strip(), thread, stop, result


def windows(payload: bytes, width: int, stride: int) -> list[bytes]:
    return [payload[i:i + width] for i in range(0, len(payload) - width + 1, stride)]


@pytest.mark.timeout(300)
def test_no_sample_byte_leaves_a_board_in_federated_rounds(tmp_path, monkeypatch, capsys):
    # Prepare: two boards with disjoint folders of their own and a third on the gateway's data, in
    # federated rounds, each board's connection through a relay that keeps what the board sends
    monkeypatch.chdir(tmp_path)
    import_gateway_set(tmp_path, capsys)
    folders = {"own-a": image_folder(tmp_path / "own-a", 60, seed=21),
               "own-b": image_folder(tmp_path / "own-b", 60, seed=22)}
    job = own_job(training={"steps": 4, "min_clients": 3},
                  aggregation={"rule": "fedavg"}, federated={"local_steps": 2, "local_batch": 8, "partitions": 1},
                  privacy={"class_counts": False})
    address, thread, stop, result = insecure_coordinator(job, tmp_path)
    proxies, clients = {}, []
    try:
        for name in (*folders, "served"):
            proxies[name] = RecordingProxy(address)
            own = ("--local-data", str(folders[name])) if name in folders else ()
            clients.append(spawn_client(proxies[name].address, name, speed=0.5, log_dir=tmp_path, extra=(
                "--insecure", "--data-dir", str(tmp_path / f"{name}-data"), *own)))

        # Execute
        thread.join(240)
        assert not thread.is_alive() and "error" not in result, result
        summary = result["summary"]
    finally:
        stop.set()
        for client in clients:
            if client.poll() is None:
                client.kill()
        for proxy in proxies.values():
            proxy.close()

    # Assert: every round trained on every board (its partition, or its own data)
    steps = read_metrics(tmp_path / "runs" / job.name)
    assert len(steps) == job.training.steps
    assert all(sorted(s["shares"].values()) == [16, 16, 16] for s in steps)
    rows = {row["device"].rsplit("-", 1)[0]: row for row in summary["devices"]}
    # the job keeps class counts on the boards: only the sample count was told
    assert rows["own-a"]["own_data"] == rows["own-b"]["own_data"] == {"samples": 60, "class_counts": None}
    assert rows["served"]["own_data"] is None
    for name, folder in folders.items():
        sent = bytes(proxies[name].sent)
        # what the board sent is its updates and the calls that carry them (the coordinator's
        # count of its upload bytes, plus a little per call), and its link probes: zeros
        uploaded = rows[name]["upload_bytes"]
        probes = sum(len(m.group()) for m in re.finditer(rb"\x00{4096,}", sent))
        assert uploaded <= len(sent) and len(sent) - probes <= uploaded * 1.02 + 64_000, (name, len(sent), uploaded)
        # and no sample: no 32-byte run of any of its images, as pixels, as the model's input
        # (normalised float32) or as the files' bytes
        local = LocalData(folder, tmp_path / "check").prepare()
        pixels = local.images.numpy()
        for image in pixels:
            for piece in windows(image.tobytes(), 32, 16) + windows(normalize(torch.from_numpy(image))
                                                                   .numpy().tobytes(), 32, 64):
                assert piece not in sent, f"{name} sent bytes of one of its images"
        for path in sorted(folder.rglob("*.*"))[:20]:
            body = path.read_bytes()[64:]  # past the headers every PNG/JPEG file shares
            assert all(piece not in sent for piece in windows(body, 32, 256)), f"{name} sent bytes of {path}"
    # the board on the gateway's data fetched its blocks; the others fetched nothing
    assert (tmp_path / "served-data" / "lab-blocks").exists()
    assert not any((tmp_path / f"{name}-data" / "lab-blocks").exists() for name in folders)


@pytest.mark.timeout(240)
def test_a_board_with_a_class_the_gateway_does_not_know_is_refused_in_one_line(tmp_path, monkeypatch, capsys,
                                                                                coordinator_factory, client_factory):
    # Prepare: a board whose folder holds a class the gateway's dataset does not have
    monkeypatch.chdir(tmp_path)
    import_gateway_set(tmp_path, capsys)
    stranger = image_folder(tmp_path / "zoo", 8, seed=3, classes=("amber", "blue", "green", "zebra"))
    job = own_job(training={"steps": 3, "min_clients": 1})
    coordinator = coordinator_factory(job)

    # Execute
    refused = client_factory(coordinator.address, "zoo-cam", extra=("--local-data", str(stranger),
                                                                     "--data-dir", str(tmp_path / "zoo-data")))
    good = client_factory(coordinator.address, "good-cam", extra=("--data-dir", str(tmp_path / "good-data")))

    # Assert: the board says which class and stops; the job trains with the other board
    assert refused.wait(120) == 2
    errors = [line for line in (tmp_path / "zoo-cam.log").read_text().splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "class 'zebra'" in errors[0] and "not one of the job's 4 classes" in errors[0]
    assert "Traceback" not in (tmp_path / "zoo-cam.log").read_text()
    summary = coordinator.wait(timeout=180)
    assert summary["steps_applied"] == 3
    assert good.wait(60) == 0


@pytest.mark.timeout(240)
def test_a_board_whose_data_disappears_leaves_and_the_others_go_on(tmp_path, monkeypatch, capsys,
                                                                   coordinator_factory, client_factory):
    # Prepare: two boards with their own data and one on the gateway's, for a time-limited job
    monkeypatch.chdir(tmp_path)
    import_gateway_set(tmp_path, capsys)
    folders = {name: image_folder(tmp_path / name, 40, seed=seed) for name, seed in (("own-a", 31), ("own-b", 32))}
    job = own_job(training={"steps": 100_000, "min_clients": 3, "time_limit_s": 12.0, "global_batch": 24})
    coordinator = coordinator_factory(job)
    boards = {name: client_factory(coordinator.address, name, 0.3, extra=(
        "--data-dir", str(tmp_path / f"{name}-data"), *(("--local-data", str(folders[name])) if name in folders
                                                          else ()))) for name in ("own-a", "own-b", "served")}
    wait_for(lambda: len(read_metrics(coordinator.run_dir)) >= 3, 120, "three steps")

    # Execute: own-b's folder is taken away mid-job
    folders["own-b"].rename(tmp_path / "taken-away")

    # Assert: own-b says why and stops; the coordinator drops it with that reason and trains on
    assert boards["own-b"].wait(60) == 2
    log = (tmp_path / "own-b.log").read_text()
    assert "is gone or unreadable" in log and "Traceback" not in log
    summary = coordinator.wait(timeout=120)
    rows = {row["device"].rsplit("-", 1)[0]: row for row in summary["devices"]}
    assert not rows["own-b"]["alive_at_end"] and "its own data is gone" in rows["own-b"]["left_reason"]
    steps = read_metrics(coordinator.run_dir)
    after = [s for s in steps if not any(d.startswith("own-b") for d in s["shares"])]
    assert len(after) >= 3 and summary["stop_reason"] == "time_limit"
    assert boards["own-a"].wait(60) == 0 and boards["served"].wait(60) == 0


@pytest.mark.timeout(180)
def test_a_hand_made_pipeline_refuses_a_board_with_only_its_own_data(tmp_path, monkeypatch, capsys,
                                                                     coordinator_factory, client_factory):
    # Prepare: a pipeline written by hand; a board with its own data asks to join
    monkeypatch.chdir(tmp_path)
    import_gateway_set(tmp_path, capsys)
    folder = image_folder(tmp_path / "own", 8, seed=4)
    job = own_job(training={"steps": 2, "min_clients": 2},
                  pipeline={"stages": [{"blocks": 2, "boards": ["p0"]}, {"blocks": 2, "boards": ["own"]}]})
    coordinator = coordinator_factory(job)

    # Execute
    board = client_factory(coordinator.address, "own", extra=("--local-data", str(folder),
                                                              "--data-dir", str(tmp_path / "own-data")))

    # Assert: one line saying why, exit code 2
    assert board.wait(120) == 2
    lines = [line for line in (tmp_path / "own.log").read_text().splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and "hand-made pipeline" in lines[0] and "first stage needs every sample" in lines[0]
    coordinator.stop.set()


def test_own_data_is_decoded_once_and_again_only_when_the_folder_changed(tmp_path):
    folder = image_folder(tmp_path / "own", 12, seed=5)
    first = LocalData(folder, tmp_path / "data").prepare()
    stamp = (first.store / "train.images").stat().st_mtime_ns
    again = LocalData(folder, tmp_path / "data").prepare()
    assert (again.store / "train.images").stat().st_mtime_ns == stamp and torch.equal(again.images, first.images)
    images, labels = colour_images(2, seed=6)  # one more blue image
    write_image_folder(folder, images[1:], labels[1:], CLASSES, stems=[99])
    grown = LocalData(folder, tmp_path / "data").prepare()
    assert grown.samples == 13 and (grown.store / "train.images").stat().st_mtime_ns != stamp
    # labels follow the job's classes by name, whatever their order there
    job_classes = ("violet", "green", "blue", "amber", "extra")
    dataset = grown.for_job(job_classes)
    assert dataset.classes == job_classes
    assert sorted(set(int(y) for y in dataset.labels)) == [0, 1, 2, 3]
    assert grown.class_counts(job_classes) == (3, 3, 4, 3, 0)
    blue = [i for i in range(len(dataset)) if int(dataset.labels[i]) == 2]
    assert all(int(dataset.images[i, 2].float().mean()) > 150 for i in blue)  # blue hue: its blue channel


def test_fleet_files_give_a_board_its_own_folder_relative_to_the_file(tmp_path):
    from edgetrain.fleet_file import load_fleet

    (tmp_path / "fleet.yaml").write_text(json.dumps({
        "boards": [{"name": "cam", "speed": 0.5, "local_data": "images/cam"}, {"name": "plain", "speed": 0.5}]}))
    fleet = load_fleet(tmp_path / "fleet.yaml")
    assert fleet.boards[0].local_data == str((tmp_path / "images" / "cam").resolve())
    assert fleet.boards[1].local_data is None


def test_the_planner_never_puts_a_stage_on_a_board_with_only_its_own_data():
    from coordinator.planning.inputs import measure_model_cost
    from coordinator.planning.planner import plan_optimal
    from edgetrain.plan import BoardCost

    # Prepare: three equal boards on fast links, for which ResNet-18 plans as a pipeline
    model = measure_model_cost("resnet18")
    flops = sum(b.train_flops for b in model.blocks) * 50

    def fleet(own: bool) -> list[BoardCost]:
        return [BoardCost(name=name, flops_per_s=flops, memory_bytes=2e9, mbit_per_s=1000, own_data=own and name == "a")
                for name in ("a", "b", "c")]

    # Execute
    free, owned = plan_optimal(fleet(False), model, 64), plan_optimal(fleet(True), model, 64)

    # Assert: with every board on the gateway's data, board a hosts a stage; holding only its own
    # data, it is a data-parallel shard or nothing
    assert "a" in {b for stage in free.stages for b in stage.boards}
    assert "a" not in {b for stage in owned.stages for b in stage.boards}


def test_load_dataset_labels_match_the_served_layout(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = import_gateway_set(tmp_path, capsys)
    from edgetrain.catalog import DatasetSpec

    test = load_dataset(DatasetSpec(name="lab", data_dir=str(data)), train=False)
    assert test.classes == CLASSES and len(test) == 120
    hue = test.images.float().mean(dim=(2, 3))  # each sample's mean colour is its class's hue
    nearest = torch.cdist(hue, torch.tensor(HUES, dtype=torch.float32)).argmin(dim=1)
    assert torch.equal(nearest, test.labels)


@pytest.mark.timeout(120)
def test_a_board_uses_its_copy_of_an_imported_dataset_only_when_it_is_the_gateways(tmp_path, monkeypatch, capsys,
                                                                                   coordinator_factory):
    from edge_client.connection import CoordinatorConnection
    from edge_client.credentials import BoardCredentials
    from edge_client.dataset import RemoteDataset, board_dataset
    from edgetrain.data import InMemoryImages

    # Prepare: the gateway's store; one board copy made from the same images, one from others
    monkeypatch.chdir(tmp_path)
    import_gateway_set(tmp_path, capsys)
    job = own_job(training={"steps": 1})
    coordinator = coordinator_factory(job)
    conn = CoordinatorConnection(coordinator.address, credentials=BoardCredentials(board_identity("copy-board"),
                                                                                   tmp_path / "copy-board"))
    same, other = tmp_path / "same", tmp_path / "other"
    shutil.copytree(tmp_path / "data" / "lab", same / "lab")
    source = tmp_path / "other-images"
    image_folder(source / "train", 480, seed=7)
    image_folder(source / "test", 120, seed=8)
    assert main(["data", "import", "imagefolder", str(source), "--name", "lab", "--data-dir", str(other),
                 "--block-samples", "100"]) == 0

    # Execute
    datasets = {where: board_dataset(job.dataset, train=True, data_dir=str(where), download=False,
                                     connection=lambda: conn) for where in (same, other)}

    # Assert: the same store is read from the board's disk; the other one is not trusted
    assert isinstance(datasets[same], InMemoryImages) and len(datasets[same]) == 480
    assert isinstance(datasets[other], RemoteDataset)
    reference = load_dataset(replace(job.dataset, data_dir="data"), train=True)
    assert torch.equal(datasets[other][5][0], reference[5][0]) and datasets[other].classes == CLASSES
    datasets[other].fetcher.close()
    conn.close()
    coordinator.stop.set()
