"""The board's training data: its own copy, or the job's dataset fetched from the gateway as steps need it.

A board whose job trains on CIFAR-10 or a dataset imported on the gateway, and that has no copy
under its --data-dir, needs neither internet access nor a copy made by hand: the coordinator
serves the datasets imported on the gateway (coordinator/data_service.py). ``RemoteDataset`` asks
for the description once (classes, split sizes, block size, each block's sha256), then fetches a
block only when a sample in it is first asked for — a board trained on the first 5000 samples
fetches 5 blocks of 1000 — checks its sha256 (a mismatch or a truncated stream is fetched again, up
to FETCH_TRIES times, then a DatasetFetchError), and caches it under DATA_DIR/<dataset>-blocks/
named by that sha256, so the next start reads it from disk (a cached block that no longer matches
its name is fetched again). Its items are those of the local loader (edgetrain.data.InMemoryImages):
the same normalised float32 image and int label for the same index.

A board's own images (`edgetrain client --local-data DIR`) are edge_client/local_data.py's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import torch
from torch.utils.data import Dataset

from edge_client.connection import CoordinatorConnection, CoordinatorUnreachable
from edge_client.credentials import trusted_calls
from edgetrain import transport
from edgetrain.catalog import DatasetSpec, dataset_is_synthetic
from edgetrain.data import load_dataset, normalize
from edgetrain.dataset_import import CIFAR10, REQUIRED_FILES, dataset_dir
from edgetrain.datastore import (
    CIFAR10_CLASSES,
    IMAGE_BYTES,
    IMAGE_SHAPE,
    MANIFEST_FILE,
    Manifest,
    SplitManifest,
    read_manifest,
)
from edgetrain.streaming import TransferError
from protos import data_pb2 as dpb
from protos import data_pb2_grpc as dpb_grpc

logger = logging.getLogger(__name__)

CACHE_DIR = "cifar10-blocks"
"""Where under the board's data directory fetched CIFAR-10 blocks are kept (one file per block,
named by its sha256); another dataset's go to `<name>-blocks` (cache_dir)."""
FETCH_TRIES = 4
"""Tries of one block (a bad checksum or a broken stream is fetched again) before giving up."""
FETCHES = transport.RetryPolicy(budget_s=30.0, max_tries=FETCH_TRIES, max_s=2.0,
                                retry_on=transport.TRANSFER_RETRY_CODES)
FETCH_TIMEOUT_S = 300.0
"""One block is 3 MB: about 25 s over a 1 Mbit/s link."""


class DatasetFetchError(ConnectionError):
    """A block kept arriving damaged (or the gateway refused it): training on it cannot go on."""


def cache_dir(data_dir: str | Path, dataset: str) -> Path:
    """Where fetched blocks of `dataset` are cached under the board's data directory."""
    return Path(data_dir) / (CACHE_DIR if dataset == CIFAR10 else f"{dataset}-blocks")


def has_local_copy(data_dir: str | Path, dataset: str = CIFAR10) -> bool:
    """Whether `data_dir` holds its own copy of `dataset` (the board then loads it itself): the
    CIFAR-10 batch files, or the store of an imported dataset."""
    directory = dataset_dir(data_dir, dataset)
    if dataset != CIFAR10:
        return (directory / MANIFEST_FILE).is_file()
    return all((directory / name).is_file() for name in REQUIRED_FILES)


def board_dataset(spec: DatasetSpec, *, train: bool, data_dir: str, download: bool,
                  connection: Callable[[], CoordinatorConnection]) -> Dataset:
    """The split the board trains on: the local loader's (synthetic data, a copy of its own, or
    CIFAR-10 with --download), else the job's dataset from the coordinator reached through
    `connection()` (the current connection: it is replaced when the board reconnects)."""
    if dataset_is_synthetic(spec) or (download and spec.name == CIFAR10) or (
            spec.name == CIFAR10 and has_local_copy(data_dir)):
        return load_dataset(replace(spec, data_dir=data_dir, download=download), train=train)
    fetcher = BlockFetcher(connection)
    manifest = None
    if has_local_copy(data_dir, spec.name):  # a copy of an imported dataset: used when it is the gateway's
        manifest = fetcher.describe(spec.name)
        if read_manifest(dataset_dir(data_dir, spec.name)).splits == manifest.splits:
            fetcher.close()
            return load_dataset(replace(spec, data_dir=data_dir), train=train)
        logger.warning("[Client.Data] the copy of %s under %s is not the coordinator's: fetching its blocks instead",
                       spec.name, data_dir)
    cache = cache_dir(data_dir, spec.name)
    logger.info("[Client.Data] no %s under %s: fetching the samples this board trains on from the "
                "coordinator at %s (cached under %s)", spec.name, data_dir, connection().address, cache)
    return RemoteDataset(fetcher, BlockCache(cache), train=train, spec=spec, manifest=manifest)


class BlockFetcher:
    """Describe and FetchBlock on the coordinator's Datasets service, over the board's current
    connection (its address, its credentials, its emulated link)."""

    def __init__(self, connection: Callable[[], CoordinatorConnection], *,
                 retry: transport.RetryPolicy = FETCHES) -> None:
        self._connection = connection
        self.retry = retry
        self._lock = threading.Lock()
        self._channel: tuple[tuple, grpc.Channel] | None = None
        self.fetched = 0
        """Blocks fetched from the coordinator so far (cache hits do not count)."""

    def _stub(self) -> tuple[CoordinatorConnection, dpb_grpc.DatasetsStub]:
        """A stub on a channel to the current coordinator, reopened when it moved or the board's
        certificate was renewed."""
        conn = self._connection()
        security = conn.credentials.gateway() if conn.credentials else transport.INSECURE
        key = (conn.address, id(conn.credentials), security.generation)
        with self._lock:
            if self._channel is None or self._channel[0] != key:
                if self._channel is not None:
                    self._channel[1].close()
                self._channel = (key, transport.open_channel(conn.address, security))
            return conn, dpb_grpc.DatasetsStub(self._channel[1])

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel[1].close()
                self._channel = None

    def _call(self, attempt: Callable[[CoordinatorConnection, dpb_grpc.DatasetsStub], object], what: str):
        conn, _ = self._stub()

        def once():
            current, stub = self._stub()
            return attempt(current, stub)

        try:
            with trusted_calls(conn.credentials):
                return self.retry.call(once, what)
        except transport.Unreachable as e:
            if isinstance(e.__cause__, TransferError):
                raise DatasetFetchError(f"{what}: {e.__cause__}; gave up after {FETCH_TRIES} tries") from e
            raise CoordinatorUnreachable(str(e)) from e
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise FileNotFoundError(f"the coordinator at {conn.address} cannot serve {what}: "
                                        f"{e.details()}") from None
            if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise DatasetFetchError(f"{what}: {transport.describe(e)}") from None
            raise

    def describe(self, dataset: str = CIFAR10) -> Manifest:
        """The coordinator's description of `dataset`: split sizes, block size, block sha256s."""
        def attempt(conn, stub) -> Manifest:
            if conn.shaper:
                conn.shaper.rpc_delay()
            reply = stub.Describe(dpb.DescribeRequest(dataset=dataset), timeout=60)
            if tuple(reply.image_shape) != IMAGE_SHAPE or reply.block_samples <= 0:
                raise DatasetFetchError(f"the coordinator describes {dataset} as images {tuple(reply.image_shape)} "
                                        f"in blocks of {reply.block_samples}; this board reads {IMAGE_SHAPE}")
            return Manifest(reply.dataset, reply.block_samples,
                            {s.name: SplitManifest(s.samples, tuple(h.hex() for h in s.block_sha256))
                             for s in reply.splits}, classes=tuple(reply.classes) or CIFAR10_CLASSES)

        return self._call(attempt, f"description of {dataset}")

    def fetch(self, manifest: Manifest, split: str, block: int) -> bytes:
        """The bytes of `block` of `split` (images then labels), checked against its sha256."""
        start, stop = manifest.block_range(split, block)
        expected = manifest.splits[split].blocks[block]
        what = f"block {block} of the {manifest.dataset} {split} split"

        def attempt(conn, stub) -> bytes:
            if conn.shaper:
                conn.shaper.rpc_delay()
            started = time.perf_counter()
            stream = stub.FetchBlock(dpb.BlockRequest(dataset=manifest.dataset, split=split, block=block),
                                     timeout=FETCH_TIMEOUT_S)
            images, labels, position = bytearray(), bytearray(), start
            for chunk in stream:
                count = len(chunk.labels)
                if chunk.first_sample != position or count == 0 or position + count > stop \
                        or len(chunk.images) != count * IMAGE_BYTES:
                    stream.cancel()
                    raise TransferError("data_loss", f"{what}: a malformed chunk (samples {chunk.first_sample}+"
                                        f"{count} with {len(chunk.images)} image bytes, expected from {position})")
                images += chunk.images
                labels += chunk.labels
                position += count
                if conn.shaper:
                    conn.shaper.after_receive(len(chunk.images) + count)
            if position != stop:
                raise TransferError("data_loss", f"{what}: the stream ended at sample {position} of {start}..{stop}")
            payload = bytes(images + labels)
            if hashlib.sha256(payload).hexdigest() != expected:
                raise TransferError("data_loss", f"{what}: its sha256 does not match the coordinator's description")
            conn.link.observe_transfer(len(payload), time.perf_counter() - started)
            return payload

        payload = self._call(attempt, what)
        self.fetched += 1
        return payload


class BlockCache:
    """Fetched blocks on the board's disk, one file per block named by its sha256."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def read(self, sha256: str, nbytes: int) -> bytes | None:
        """The cached block with this sha256 (None: not cached, or damaged — then removed)."""
        path = self.directory / f"{sha256}.block"
        try:
            payload = path.read_bytes()
        except FileNotFoundError:
            return None
        if len(payload) == nbytes and hashlib.sha256(payload).hexdigest() == sha256:
            return payload
        logger.warning("[Client.Data] cached block %s is damaged; fetching it again", path)
        path.unlink(missing_ok=True)
        return None

    def write(self, sha256: str, payload: bytes) -> None:
        """Keep a checked block (written whole or not at all)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{sha256}.block"
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_bytes(payload)
        partial.replace(path)


class RemoteDataset(Dataset):
    """The first samples of a split of the job's dataset as the coordinator serves them (as many
    as `spec` asks for, or `size`), each block fetched (or read from the cache) when one of its
    samples is first asked for. Items are ``(float32 (3, 32, 32) normalised image, int label)``,
    as the local loader's; `classes` names the labels."""

    def __init__(self, fetcher: BlockFetcher, cache: BlockCache, *, train: bool, size: int | None = None,
                 spec: DatasetSpec | None = None, manifest: Manifest | None = None) -> None:
        self.fetcher = fetcher
        self.cache = cache
        self.split = "train" if train else "test"
        name = spec.name if spec is not None else CIFAR10
        what = "CIFAR-10" if name == CIFAR10 else repr(name)
        self.manifest = manifest or fetcher.describe(name)
        self.classes = self.manifest.classes
        if self.split not in self.manifest.splits:
            raise DatasetFetchError(f"the coordinator's {what} has no {self.split} split")
        available = self.manifest.splits[self.split].samples
        if size is None:
            size = spec.split_size(train=train, available=available) if spec is not None else available
        if size > available:
            raise ValueError(f"requested {size} samples but the {what} {self.split} split has {available} "
                             "(on the gateway)")
        self.size = size
        self._lock = threading.Lock()
        self._blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        index = int(index)
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} items")
        block, position = divmod(index, self.manifest.block_samples)
        images, labels = self.block(block)
        return normalize(images[position]), int(labels[position])

    def block(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 (n, 3, 32, 32) images, int64 labels) of `block`: from memory, the cache, or the
        coordinator, in that order."""
        with self._lock:
            if block not in self._blocks:
                self._blocks[block] = self._load(block)
            return self._blocks[block]

    def _load(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, stop = self.manifest.block_range(self.split, block)
        count = stop - start
        sha256 = self.manifest.splits[self.split].blocks[block]
        payload = self.cache.read(sha256, count * (IMAGE_BYTES + 1))
        if payload is None:
            started = time.perf_counter()
            payload = self.fetcher.fetch(self.manifest, self.split, block)
            self.cache.write(sha256, payload)
            logger.info("[Client.Data] fetched block %d of the %s %s split (%d samples, %.1f MB) in %.2f s",
                        block, self.manifest.dataset, self.split, count, len(payload) / 1e6,
                        time.perf_counter() - started)
        array = np.frombuffer(payload, dtype=np.uint8)
        images = torch.from_numpy(array[:count * IMAGE_BYTES].copy()).view(count, *IMAGE_SHAPE)
        labels = torch.from_numpy(array[count * IMAGE_BYTES:].astype(np.int64))
        return images, labels
