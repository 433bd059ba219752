"""The Datasets service: the gateway serves boards the blocks of samples they train on.

Datasets are imported once on the gateway (`edgetrain data import`, edgetrain/dataset_import.py):
CIFAR-10 in its own files, anything else as a store (edgetrain/datastore.py); either way with a
manifest of class names and per-block sha256 sums. This service, on the coordinator's fleet port
under the same mutual TLS, describes a manifest (``Describe``) and streams one block at a time
(``FetchBlock``), so a board without a copy fetches just the samples it is asked for
(edge_client/dataset.py). It serves CIFAR-10, the job's dataset and whatever else is imported in
its data directory; a name never imported there is NOT_FOUND. Only boards and the gateway may call it (the fleet
port's Guard already refused callers without a valid fleet certificate; an operator's is refused
here).

The imported files are read on the first fetch of a split and checked block by block against the
manifest before anything is served: a copy changed or damaged after its import is refused
(FAILED_PRECONDITION, saying to import again) rather than served under sums it no longer matches.
A new import is picked up without a restart (the manifest's modification time is watched).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc

from edgetrain import transport, trust
from edgetrain.catalog import IMPORTED_NAME, SYNTHETIC_DATASET_NAMES
from edgetrain.dataset_import import CIFAR10, dataset_dir, import_command, read_imported_split
from edgetrain.datastore import (
    IMAGE_SHAPE,
    MANIFEST_FILE,
    DatasetImportError,
    Manifest,
    read_manifest,
)
from edgetrain.errors import Refusal
from protos import data_pb2 as dpb
from protos import data_pb2_grpc as dpb_grpc

logger = logging.getLogger(__name__)

CHUNK_SAMPLES = 256
"""Samples per streamed message: 256 x 3073 bytes = 787 KB, under the 1 MiB a message may carry
(transport's chunks are 512 KiB - 1 MiB for the same reason: large enough to stream at link speed,
small enough that a broken stream loses little)."""
CALLERS = frozenset({trust.BOARD, trust.GATEWAY})
"""Who may fetch the dataset: the fleet's boards, and the gateway itself."""


class _Refused(Exception):
    """A request the service answers with `code` and a one-line message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ImportedDataset:
    """A dataset imported under a data directory: its manifest, and its splits loaded (and
    checked against the manifest) on first use. Thread-safe."""

    def __init__(self, data_dir: str | Path, name: str = CIFAR10) -> None:
        self.data_dir = Path(data_dir)
        self.name = name
        self.directory = dataset_dir(data_dir, name)
        self._lock = threading.Lock()
        self._loading = threading.Lock()  # one split load at a time: boards starting together wait for it
        self._stamp: int | None = None
        self._manifest: Manifest | None = None
        self._splits: dict[str, tuple] = {}

    def _missing(self, why: str) -> _Refused:
        return _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                        f"this gateway {why}: run `{import_command(self.name, self.data_dir)}` on it "
                        "(or serve with the --data-dir it was imported into)")

    def manifest(self) -> Manifest:
        """The current manifest (re-read when a new import replaced it)."""
        path = self.directory / MANIFEST_FILE
        with self._lock:
            try:
                stamp = path.stat().st_mtime_ns
            except FileNotFoundError:
                raise self._missing(f"has no {self.name} imported under {self.data_dir}") from None
            if stamp != self._stamp:
                try:
                    manifest = read_manifest(self.directory)
                except DatasetImportError as e:
                    raise self._missing(f"cannot read its {self.name} manifest ({e})") from None
                if manifest is None:
                    raise self._missing(f"has no {self.name} imported under {self.data_dir}")
                self._stamp, self._manifest, self._splits = stamp, manifest, {}
            return self._manifest

    def block(self, split: str, block: int) -> tuple:
        """(index of its first sample, images uint8 (n, 3072), labels uint8 (n)) of `block` of
        `split`."""
        manifest = self.manifest()
        if not split:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "a block request needs a split (train or test)")
        if split not in manifest.splits:
            raise _Refused(grpc.StatusCode.NOT_FOUND, f"{self.name} has no split {split!r} "
                                                      f"(it has {', '.join(manifest.splits)})")
        try:
            start, stop = manifest.block_range(split, block)
        except IndexError as e:
            raise _Refused(grpc.StatusCode.NOT_FOUND, str(e)) from None
        images, labels = self._split(manifest, split)
        return start, images[start:stop], labels[start:stop]

    def _split(self, manifest: Manifest, split: str) -> tuple:
        with self._loading:
            return self._load(manifest, split)

    def _load(self, manifest: Manifest, split: str) -> tuple:
        with self._lock:
            if manifest is self._manifest and split in self._splits:
                return self._splits[split]
        try:
            images, labels = read_imported_split(self.directory, manifest, split)
        except DatasetImportError as e:
            raise self._missing(f"cannot serve its imported {self.name} ({e})") from None
        logger.info("[Datasets] loaded the %s %s split from %s (%d samples, %d blocks checked)", self.name, split,
                    self.directory, len(labels), len(manifest.splits[split].blocks))
        with self._lock:
            if manifest is self._manifest:
                self._splits[split] = (images, labels)
        return images, labels


class DatasetsServicer(dpb_grpc.DatasetsServicer):
    """Describes the imported datasets and streams their blocks to the fleet's boards."""

    def __init__(self, data_dir: str | Path, dataset: str = CIFAR10) -> None:
        self.data_dir = Path(data_dir)
        self.expected = {CIFAR10, dataset} - set(SYNTHETIC_DATASET_NAMES)
        """Datasets that must be imported (the job's; CIFAR-10 always may be): a missing one is
        FAILED_PRECONDITION, saying which import to run."""
        self._datasets: dict[str, ImportedDataset] = {}
        self._lock = threading.Lock()

    def _admit(self, context, rpc: str) -> None:
        peer = transport.peer_of(context)  # None only on an --insecure (plaintext) server
        if peer is not None and peer.role not in CALLERS:
            _refuse(context, rpc, grpc.StatusCode.PERMISSION_DENIED,
                    f"the dataset is served to boards and the gateway, not to {peer.role} {peer.name}",
                    Refusal.NOT_PERMITTED)

    def _dataset(self, context, rpc: str, name: str) -> ImportedDataset:
        if name not in self.expected and not (IMPORTED_NAME.fullmatch(name) and
                                              (dataset_dir(self.data_dir, name) / MANIFEST_FILE).is_file()):
            _refuse(context, rpc, grpc.StatusCode.NOT_FOUND,
                    f"this gateway serves no dataset {name!r} (it serves {', '.join(sorted(self.expected))} "
                    "and what `edgetrain data list` shows)")
        with self._lock:
            if name not in self._datasets:
                self._datasets[name] = ImportedDataset(self.data_dir, name)
            return self._datasets[name]

    def Describe(self, request: dpb.DescribeRequest, context) -> dpb.DatasetDescription:
        self._admit(context, "Describe")
        try:
            manifest = self._dataset(context, "Describe", request.dataset).manifest()
        except _Refused as e:
            _refuse(context, "Describe", e.code, str(e))
        return dpb.DatasetDescription(
            dataset=manifest.dataset, block_samples=manifest.block_samples, image_shape=list(IMAGE_SHAPE),
            classes=list(manifest.classes),
            splits=[dpb.SplitDescription(name=name, samples=s.samples, block_sha256=[bytes.fromhex(h) for h in s.blocks])
                    for name, s in manifest.splits.items()])

    def FetchBlock(self, request: dpb.BlockRequest, context) -> Iterator[dpb.BlockChunk]:
        self._admit(context, "FetchBlock")
        dataset = self._dataset(context, "FetchBlock", request.dataset)
        try:
            start, images, labels = dataset.block(request.split, request.block)
        except _Refused as e:
            _refuse(context, "FetchBlock", e.code, str(e))
        return _chunks(images, labels, start)


def _chunks(images, labels, first: int) -> Iterator[dpb.BlockChunk]:
    for offset in range(0, len(labels), CHUNK_SAMPLES):
        stop = offset + CHUNK_SAMPLES
        yield dpb.BlockChunk(first_sample=first + offset, images=images[offset:stop].tobytes(),
                             labels=labels[offset:stop].tobytes())


def _refuse(context, rpc: str, code: grpc.StatusCode, message: str, reason: Refusal = Refusal.UNSPECIFIED) -> None:
    logger.warning("[Datasets.%s] %s: %s", rpc, code.name, message)
    transport.abort(context, code, message, reason)


def datasets_service(data_dir: str | Path, dataset: str = CIFAR10) -> list:
    """The (add_to_server, servicer) pair to serve `dataset` next to the Coordinator service."""
    return [(dpb_grpc.add_DatasetsServicer_to_server, DatasetsServicer(data_dir, dataset))]
