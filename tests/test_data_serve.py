"""CIFAR-10 placed once on the gateway and served to boards: `edgetrain data import` checks and
places an archive in CIFAR-10's own file format, a real coordinator (mutual TLS) serves its
blocks, and a board identity fetches, checks and caches them (edge_client/dataset.py).

The archive is generated here (a few hundred random images per batch file, the same pickle keys
and dtypes as the real release), so the test needs no download; it is not the official release.
"""

from __future__ import annotations

import io
import pickle
import tarfile
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from conftest import board_channel, board_identity, read_metrics, small_job

from edge_client.connection import CoordinatorConnection
from edge_client.credentials import BoardCredentials
from edge_client.dataset import (
    CACHE_DIR,
    FETCH_TRIES,
    FETCHES,
    BlockCache,
    BlockFetcher,
    DatasetFetchError,
    RemoteDataset,
    board_dataset,
)
from edgetrain import transport, trust
from edgetrain.catalog import DatasetSpec
from edgetrain.cli import main
from edgetrain.data import InMemoryImages
from edgetrain.dataset_import import CIFAR10_DIR, MANIFEST_FILE, load_manifest, read_split
from edgetrain.errors import Refusal
from protos import data_pb2 as dpb
from protos import data_pb2_grpc as dpb_grpc

pytestmark = pytest.mark.timeout(60)

PER_BATCH = 200
BLOCK = 128
"""Samples per block in these tests: 1000 training samples make 7 full blocks and one of 104."""
RPC_TIMEOUT_S = 10


def _batch_file(images: np.ndarray, labels: np.ndarray, name: str) -> bytes:
    entry = {"batch_label": name, "labels": [int(x) for x in labels], "data": images,
             "filenames": [f"{name}_{i}.png" for i in range(len(labels))]}
    return pickle.dumps(entry, protocol=2)


def _write_archive(path: Path, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, payload in files.items():
            info = tarfile.TarInfo(f"{CIFAR10_DIR}/{name}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


@pytest.fixture(scope="module")
def cifar_like(tmp_path_factory) -> tuple[Path, dict[str, tuple[np.ndarray, np.ndarray]], dict[str, bytes]]:
    """(archive path, {split: (images (N, 3072), labels)}, {file name: bytes}) of a small archive
    in CIFAR-10's python format: 5 training batches and a test batch of 200 random images."""
    rng = np.random.default_rng(17)
    files: dict[str, bytes] = {}
    splits: dict[str, list] = {"train": [], "test": []}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        images = rng.integers(0, 256, (PER_BATCH, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, PER_BATCH)
        files[name] = _batch_file(images, labels, name)
        splits["test" if name == "test_batch" else "train"].append((images, labels))
    files["batches.meta"] = pickle.dumps({"label_names": [f"class{i}" for i in range(10)],
                                          "num_cases_per_batch": PER_BATCH, "num_vis": 3072}, protocol=2)
    archive = tmp_path_factory.mktemp("download") / "cifar-10-python.tar.gz"
    _write_archive(archive, files)
    arrays = {split: (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]).astype(np.uint8))
              for split, parts in splits.items()}
    return archive, arrays, files


def _import(source: Path, data_dir: Path, capsys) -> tuple[int, str]:
    code = main(["data", "import", "cifar10", str(source), "--data-dir", str(data_dir),
                 "--block-samples", str(BLOCK)])
    return code, capsys.readouterr().err


def test_import_places_the_batches_where_the_loader_looks_and_describes_their_blocks(cifar_like, tmp_path, capsys):
    archive, arrays, _ = cifar_like
    code, err = _import(archive, tmp_path / "data", capsys)
    assert code == 0
    assert "not the official CIFAR-10 release" in err  # generated here: the import says so
    directory = tmp_path / "data" / CIFAR10_DIR
    for split, (images, labels) in arrays.items():
        placed_images, placed_labels = read_split(directory, split)
        assert np.array_equal(placed_images, images) and np.array_equal(placed_labels, labels)
    manifest = load_manifest(tmp_path / "data")
    assert manifest.block_samples == BLOCK and not manifest.official
    assert {name: (s.samples, len(s.blocks)) for name, s in manifest.splits.items()} == {
        "train": (1000, 8), "test": (200, 2)}
    # the extracted directory imports in place too, and describes the same blocks
    assert _import(directory, tmp_path / "data", capsys)[0] == 0
    assert load_manifest(tmp_path / "data").splits == manifest.splits


def test_a_bad_archive_or_batch_is_one_line_naming_the_file(cifar_like, tmp_path, capsys):
    archive, _, files = cifar_like
    truncated = tmp_path / "truncated.tar.gz"
    truncated.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    no_test = tmp_path / "no-test"
    no_test.mkdir()
    for name, payload in files.items():
        if name != "test_batch":
            (no_test / name).write_bytes(payload)
    wrong_dtype = tmp_path / "wrong-dtype"
    wrong_dtype.mkdir()
    for name, payload in files.items():
        (wrong_dtype / name).write_bytes(payload)
    (wrong_dtype / "data_batch_3").write_bytes(pickle.dumps(
        {"data": np.zeros((4, 3072), np.float32), "labels": [0, 1, 2, 3]}, protocol=2))
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    for name, payload in files.items():
        (hostile / name).write_bytes(payload)
    (hostile / "test_batch").write_bytes(b"cos\nsystem\n(S'true'\ntR.")  # would run a command
    cases = [(tmp_path / "absent.tar.gz", "absent.tar.gz: no such file"),
             (truncated, "truncated.tar.gz: truncated"),
             (no_test, "test_batch: missing"),
             (wrong_dtype, "data_batch_3: 'data' must be uint8"),
             (hostile, "test_batch: not a CIFAR python batch")]
    for source, expected in cases:
        code, err = _import(source, tmp_path / "data", capsys)
        assert code == 2, source
        assert expected in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "data" / CIFAR10_DIR).exists()  # nothing half-imported was left behind
    assert [p.name for p in (tmp_path / "data").iterdir()] == []


@pytest.fixture
def gateway(cifar_like, tmp_path, monkeypatch, coordinator_factory, capsys):
    """A real coordinator (mutual TLS) whose data directory (./data) holds the imported archive."""
    monkeypatch.chdir(tmp_path)
    assert _import(cifar_like[0], Path("data"), capsys)[0] == 0
    return coordinator_factory(small_job())


def _board(address: str, name: str, tmp_path: Path) -> CoordinatorConnection:
    """A board's real connection to the coordinator, with a certificate of the session's fleet."""
    return CoordinatorConnection(address, credentials=BoardCredentials(board_identity(name), tmp_path / name))


def _reference(arrays, split: str) -> InMemoryImages:
    """The local loader's dataset of the same samples (edgetrain.data._load_cifar10's layout)."""
    images, labels = arrays[split]
    return InMemoryImages(torch.from_numpy(images.reshape(-1, 3, 32, 32).copy()), torch.from_numpy(labels))


def test_a_board_fetches_checks_and_caches_only_the_blocks_it_needs(cifar_like, gateway, tmp_path):
    _, arrays, _ = cifar_like
    conn = _board(gateway.address, "data-board", tmp_path)
    board_dir = tmp_path / "board-data"
    spec = DatasetSpec(name="cifar10", train_size=1000)
    fetcher = BlockFetcher(lambda: conn)
    dataset = RemoteDataset(fetcher, BlockCache(board_dir / CACHE_DIR), train=True, size=1000)
    reference = _reference(arrays, "train")
    assert len(dataset) == len(reference) == 1000
    wanted = [0, 5, 127, 400, 999]  # blocks 0, 3 and the short last block 7
    for index in wanted:
        image, label = dataset[index]
        expected_image, expected_label = reference[index]
        assert torch.equal(image, expected_image) and label == expected_label
    assert fetcher.fetched == 3
    assert torch.equal(dataset.block(7)[0], reference.images[896:1000])
    assert len(list((board_dir / CACHE_DIR).iterdir())) == 3

    # the next start reads the cache: nothing is fetched again
    cached = board_dataset(spec, train=True, data_dir=str(board_dir), download=False, connection=lambda: conn)
    assert isinstance(cached, RemoteDataset)
    assert all(torch.equal(cached[i][0], reference[i][0]) for i in wanted)
    again = cached.fetcher
    assert again.fetched == 0

    # a damaged cached block is fetched again (and its file repaired)
    block3 = board_dir / CACHE_DIR / f"{dataset.manifest.splits['train'].blocks[3]}.block"
    damaged = bytearray(block3.read_bytes())
    damaged[100] ^= 0xFF
    block3.write_bytes(bytes(damaged))
    repaired = RemoteDataset(again, BlockCache(board_dir / CACHE_DIR), train=True, size=1000)
    assert torch.equal(repaired[400][0], reference[400][0]) and again.fetched == 1
    assert block3.read_bytes() != bytes(damaged)

    # the test split is served too
    test_set = RemoteDataset(again, BlockCache(board_dir / CACHE_DIR), train=False, size=200)
    assert torch.equal(test_set[199][0], _reference(arrays, "test")[199][0])

    # a block that never matches its sha256 is tried FETCH_TRIES times, then a clear error
    quick = BlockFetcher(lambda: conn, retry=replace(FETCHES, initial_s=0.01))
    wrong = RemoteDataset(quick, BlockCache(tmp_path / "other-cache"), train=True, size=1000)
    blocks = list(wrong.manifest.splits["train"].blocks)
    blocks[2] = "0" * 64
    wrong.manifest = replace(wrong.manifest, splits={**wrong.manifest.splits, "train": replace(
        wrong.manifest.splits["train"], blocks=tuple(blocks))})
    with pytest.raises(DatasetFetchError, match=f"sha256 does not match.*after {FETCH_TRIES} tries"):
        wrong[300]
    with pytest.raises(ValueError, match="requested 2000 samples but the CIFAR-10 train split has 1000"):
        RemoteDataset(quick, BlockCache(tmp_path / "other-cache"), train=True, size=2000)
    fetcher.close()
    again.close()
    quick.close()
    conn.close()


def _refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value


def test_bad_requests_get_precise_statuses_and_strangers_are_refused(gateway, fleet_authority, tmp_path):
    channel = board_channel(gateway.address, "data-board")
    stub = dpb_grpc.DatasetsStub(channel)

    def fetch(dataset="cifar10", split="train", block=0, stub=stub):
        return list(stub.FetchBlock(dpb.BlockRequest(dataset=dataset, split=split, block=block),
                                    timeout=RPC_TIMEOUT_S))

    for call, code, text in [
            (lambda: stub.Describe(dpb.DescribeRequest(dataset="mnist"), timeout=RPC_TIMEOUT_S),
             grpc.StatusCode.NOT_FOUND, "no dataset 'mnist'"),
            (lambda: fetch(dataset="mnist"), grpc.StatusCode.NOT_FOUND, "no dataset 'mnist'"),
            (lambda: fetch(split="valid"), grpc.StatusCode.NOT_FOUND, "no split 'valid'"),
            (lambda: fetch(split=""), grpc.StatusCode.INVALID_ARGUMENT, "needs a split"),
            (lambda: fetch(block=8), grpc.StatusCode.NOT_FOUND, "block 8 of the train split does not exist")]:
        error = _refusal(call)
        assert error.code() == code and text in error.details(), transport.describe(error)
    chunks = fetch(block=7)  # the server keeps serving
    assert [c.first_sample for c in chunks] == [896] and len(chunks[0].labels) == 104
    full = fetch(split="train", block=1)
    assert sum(len(c.labels) for c in full) == BLOCK and all(c.ByteSize() <= 1 << 20 for c in full)

    # an operator's certificate is the fleet's but not a board's: refused
    operator = dpb_grpc.DatasetsStub(transport.open_channel(
        gateway.address, fleet_authority.operator_identity().security(trust.GATEWAY_SERVER_NAME)))
    error = _refusal(lambda: operator.Describe(dpb.DescribeRequest(dataset="cifar10"), timeout=RPC_TIMEOUT_S))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert transport.error_reason(error) == Refusal.NOT_PERMITTED
    # no certificate, or one of another fleet: the handshake fails
    anonymous = grpc.secure_channel(gateway.address, grpc.ssl_channel_credentials(fleet_authority.ca_pem),
                                    options=[("grpc.ssl_target_name_override", trust.GATEWAY_SERVER_NAME)])
    stranger = trust.Authority.create(tmp_path / "other").issue_identity("data-board", trust.BOARD)
    forged = trust.Identity(stranger.key, stranger.cert, fleet_authority.ca_pem)
    for outsider in (anonymous, transport.open_channel(gateway.address, forged.security())):
        outsider_stub = dpb_grpc.DatasetsStub(outsider)
        error = _refusal(lambda stub=outsider_stub: fetch(stub=stub))
        assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)
        outsider.close()

    # a gateway without the data says which import to run; an import brings it back
    Path("data", CIFAR10_DIR).rename("moved")
    error = _refusal(lambda: fetch())
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "edgetrain data import cifar10 cifar-10-python.tar.gz --data-dir data" in error.details()
    Path("moved").rename(Path("data", CIFAR10_DIR))
    (Path("data", CIFAR10_DIR) / MANIFEST_FILE).touch()  # as a new import would: read again
    assert sum(len(c.labels) for c in fetch(block=2)) == BLOCK
    channel.close()


@pytest.mark.slow
def test_a_board_without_a_copy_trains_on_the_gateways_cifar10(cifar_like, tmp_path, monkeypatch, capsys,
                                                               coordinator_factory, client_factory):
    # the coordinator evaluates from its own copy, read with EdgeTrain's reader against its manifest
    monkeypatch.chdir(tmp_path)
    assert _import(cifar_like[0], Path("data"), capsys)[0] == 0
    job = small_job(dataset={"name": "cifar10", "train_size": 1000, "test_size": 200}, training={"steps": 3})
    running = coordinator_factory(job)
    board_dir = tmp_path / "board-data"
    client = client_factory(running.address, "cifar-board", extra=("--data-dir", str(board_dir)))
    running.wait(120)
    assert [r["step"] for r in read_metrics(running.run_dir)] == [0, 1, 2]
    assert client.wait(30) == 0
    cached = {p.name.removesuffix(".block") for p in (board_dir / CACHE_DIR).iterdir()}
    assert cached and cached <= set(load_manifest("data").splits["train"].blocks)
    assert not (board_dir / CIFAR10_DIR).exists()
    assert "fetched block" in (tmp_path / "cifar-board.log").read_text()
