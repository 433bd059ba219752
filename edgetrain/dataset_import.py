"""CIFAR-10 placed once on the gateway: checked, put where the loader finds it, and described.

``edgetrain data import cifar10 PATH`` takes the python-version archive
(``cifar-10-python.tar.gz``) or its extracted ``cifar-10-batches-py`` directory, checks every
batch file (pickled dicts whose ``data`` is uint8 (N, 3072) and ``labels`` N ints in 0..9), puts
the files under ``DATA_DIR/cifar-10-batches-py`` (where ``edgetrain.data``'s loader, torchvision's
CIFAR10 with ``root=DATA_DIR``, reads them) and writes a manifest next to them: each split's
size and the sha256 of each block of ``block_samples`` consecutive samples.

The manifest is what the coordinator's Datasets service (coordinator/data_service.py) describes
to boards and what a board (edge_client/dataset.py) checks each fetched block against. The block
format lives here, in the shared core, so both sides hash the same bytes: a block's images
(uint8, channel-major 3x32x32 each, as CIFAR-10 stores them) followed by its labels (one byte
each). Nothing here imports torch or numpy at module level: `edgetrain --help` stays fast.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import pickle
import shutil
import sys
import tarfile
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CIFAR10 = "cifar10"
"""The dataset name jobs and the Datasets service use."""
CIFAR10_DIR = "cifar-10-batches-py"
"""The directory the archive unpacks to, and where torchvision's CIFAR10 looks under its root."""
SPLIT_FILES: dict[str, tuple[str, ...]] = {
    "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
    "test": ("test_batch",),
}
"""The batch files of each split, in sample order."""
META_FILE = "batches.meta"
MANIFEST_FILE = "edgetrain-manifest.json"
"""The manifest, inside the CIFAR-10 directory (torchvision ignores files it does not know)."""
IMAGE_SHAPE = (3, 32, 32)
IMAGE_BYTES = 3 * 32 * 32
NUM_CLASSES = 10
DEFAULT_BLOCK_SAMPLES = 1000
"""Samples per block: 3 MB, a few seconds on a slow board link; 50 blocks hold the training split,
so a board trained on the first 5000 samples fetches 5 of them."""
MANIFEST_FORMAT = 1


class DatasetImportError(ValueError):
    """The dataset given (or found) is not usable; the message is one line naming the file."""


def import_command(dataset: str = CIFAR10, data_dir: str | Path = "data") -> str:
    """The command that places `dataset` on a gateway whose data directory is `data_dir`."""
    return f"edgetrain data import {dataset} cifar-10-python.tar.gz --data-dir {data_dir}"


# --- reading the batch files ----------------------------------------------------------------------

_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"): ("numpy._core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"): ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"): ("numpy", "ndarray"),
    ("numpy", "dtype"): ("numpy", "dtype"),
    ("_codecs", "encode"): ("_codecs", "encode"),
}


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only: a batch file that names anything else
    (which a pickle can, to run code) is refused instead of executed."""

    def find_class(self, module: str, name: str) -> Any:
        target = _ALLOWED_GLOBALS.get((module, name))
        if target is None:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a CIFAR-10 batch never does")
        return super().find_class(*target)


def _unpickle(path: Path) -> Any:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DatasetImportError(f"{path}: missing") from None
    except OSError as e:
        raise DatasetImportError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        return _ArrayUnpickler(io.BytesIO(data), encoding="latin1").load()
    except EOFError:
        raise DatasetImportError(f"{path}: truncated ({len(data)} bytes)") from None
    except Exception as e:  # noqa: BLE001 - any failure to decode the file is one answer: not a batch
        raise DatasetImportError(f"{path}: not a CIFAR-10 python batch ({type(e).__name__}: {e})") from None


def read_batch(path: Path):
    """The (uint8 (N, 3072) images, uint8 (N,) labels) of one CIFAR-10 batch file, checked."""
    import numpy as np

    entry = _unpickle(path)
    if not isinstance(entry, dict):
        raise DatasetImportError(f"{path}: not a CIFAR-10 python batch (a {type(entry).__name__}, not a dict)")
    entry = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in entry.items()}
    for key in ("data", "labels"):
        if key not in entry:
            raise DatasetImportError(f"{path}: not a CIFAR-10 python batch (no {key!r} key)")
    images = entry["data"]
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 2 \
            or images.shape[1] != IMAGE_BYTES or images.shape[0] == 0:
        what = f"{images.dtype} {images.shape}" if isinstance(images, np.ndarray) else type(images).__name__
        raise DatasetImportError(f"{path}: 'data' must be uint8 (N, {IMAGE_BYTES}) with N > 0, got {what}")
    try:
        labels = np.asarray(entry["labels"], dtype=np.int64)
    except (TypeError, ValueError):
        raise DatasetImportError(f"{path}: 'labels' must be a list of integers") from None
    if labels.shape != (images.shape[0],):
        raise DatasetImportError(f"{path}: {labels.size} labels for {images.shape[0]} images")
    if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise DatasetImportError(f"{path}: labels must be in 0..{NUM_CLASSES - 1}, "
                                 f"found {labels.min()}..{labels.max()}")
    return np.ascontiguousarray(images), labels.astype(np.uint8)


def read_split(directory: Path, split: str):
    """The (images, labels) of a whole split: its batch files concatenated in order."""
    import numpy as np

    parts = [read_batch(directory / name) for name in SPLIT_FILES[split]]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _check_meta(directory: Path) -> None:
    meta = _unpickle(directory / META_FILE)
    names = meta.get("label_names") if isinstance(meta, dict) else None
    if not isinstance(names, list) or len(names) != NUM_CLASSES:
        raise DatasetImportError(f"{directory / META_FILE}: needs 'label_names', a list of {NUM_CLASSES} names")


# --- blocks and the manifest ----------------------------------------------------------------------

def block_bytes(images, labels) -> bytes:
    """The bytes a block's sha256 covers: its images (uint8, in order) then its labels."""
    return images.tobytes() + labels.tobytes()


def block_sha256(images, labels) -> str:
    """Hex sha256 of a block (see block_bytes)."""
    return hashlib.sha256(block_bytes(images, labels)).hexdigest()


@dataclass(frozen=True)
class SplitManifest:
    samples: int
    blocks: tuple[str, ...]
    """Hex sha256 of each block."""


@dataclass(frozen=True)
class Manifest:
    """What an imported dataset holds: split sizes and the sha256 of each block of samples."""

    dataset: str
    block_samples: int
    splits: dict[str, SplitManifest]
    official: bool = False
    """Whether the files are byte for byte the official release (torchvision's md5 sums)."""
    extra: dict = field(default_factory=dict, compare=False)

    def block_range(self, split: str, block: int) -> tuple[int, int]:
        """[start, stop) sample indices of `block` of `split` (KeyError / IndexError if none)."""
        entry = self.splits[split]
        if not 0 <= block < len(entry.blocks):
            raise IndexError(f"block {block} of the {split} split does not exist "
                             f"(it has {len(entry.blocks)} blocks of {self.block_samples} samples)")
        start = block * self.block_samples
        return start, min(start + self.block_samples, entry.samples)

    def to_json(self) -> str:
        return json.dumps({"format": MANIFEST_FORMAT, "dataset": self.dataset, "block_samples": self.block_samples,
                           "official": self.official, "image_shape": list(IMAGE_SHAPE), **self.extra,
                           "splits": {name: {"samples": s.samples, "block_sha256": list(s.blocks)}
                                      for name, s in self.splits.items()}}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: Path) -> Manifest:
        try:
            data = json.loads(text)
            if data["format"] != MANIFEST_FORMAT:
                raise ValueError(f"format {data['format']}, this edgetrain reads {MANIFEST_FORMAT}")
            splits = {name: SplitManifest(int(s["samples"]), tuple(str(h) for h in s["block_sha256"]))
                      for name, s in data["splits"].items()}
            known = {"format", "dataset", "block_samples", "official", "image_shape", "splits"}
            return cls(str(data["dataset"]), int(data["block_samples"]), splits, bool(data["official"]),
                       {k: v for k, v in data.items() if k not in known})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DatasetImportError(f"{where}: not an edgetrain dataset manifest ({e}); import the dataset "
                                     "again") from None


def build_manifest(directory: Path, *, block_samples: int = DEFAULT_BLOCK_SAMPLES,
                   official: bool = False, extra: dict | None = None) -> Manifest:
    """Check every file of the CIFAR-10 directory and describe its blocks."""
    if block_samples <= 0:
        raise DatasetImportError(f"block size must be > 0 samples, got {block_samples}")
    _check_meta(directory)
    splits = {}
    for split in SPLIT_FILES:
        images, labels = read_split(directory, split)
        blocks = tuple(block_sha256(images[start:start + block_samples], labels[start:start + block_samples])
                       for start in range(0, len(labels), block_samples))
        splits[split] = SplitManifest(len(labels), blocks)
    return Manifest(CIFAR10, block_samples, splits, official, extra or {})


def load_manifest(data_dir: str | Path) -> Manifest | None:
    """The manifest of the CIFAR-10 imported under `data_dir` (None: none imported there)."""
    path = Path(data_dir) / CIFAR10_DIR / MANIFEST_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DatasetImportError(f"{path}: cannot read it ({e.strerror})") from None
    return Manifest.from_json(text, path)


OFFICIAL_MD5 = {
    "data_batch_1": "c99cafc152244af753f735de768cd75f", "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
    "data_batch_3": "54ebc095f3ab1f0389bbae665268c751", "data_batch_4": "634d18415352ddfa80567beed471001a",
    "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb", "test_batch": "40351d587109b95175f43aff81a1287e",
    "batches.meta": "5ff9c542aee3614f3951f8cda6e48888",
}
"""md5 sums of the official release's files: the ones torchvision's CIFAR10 checks before it loads
them (torchvision/datasets/cifar.py; copied here because importing torchvision takes seconds)."""


def is_official(directory: Path) -> bool:
    """Whether every file is the official release's (torchvision's loader refuses anything else)."""
    return all(hashlib.md5((directory / name).read_bytes(), usedforsecurity=False).hexdigest() == md5
               for name, md5 in OFFICIAL_MD5.items())


# --- placing the files ----------------------------------------------------------------------------

REQUIRED_FILES = (*SPLIT_FILES["train"], *SPLIT_FILES["test"], META_FILE)


def _extract(archive: Path, into: Path) -> None:
    """Copy the CIFAR-10 files out of `archive` (only those: no path the archive names is trusted)."""
    wanted = {f"{CIFAR10_DIR}/{name}" for name in REQUIRED_FILES}
    found: set[str] = set()
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                if member.name in wanted and member.isfile():
                    source = tar.extractfile(member)
                    with source, open(into / Path(member.name).name, "wb") as out:
                        shutil.copyfileobj(source, out)
                    found.add(member.name)
    except FileNotFoundError:
        raise DatasetImportError(f"{archive}: no such file") from None
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise DatasetImportError(f"{archive}: truncated or not a .tar.gz archive ({e})") from None
    missing = sorted(wanted - found)
    if missing:
        raise DatasetImportError(f"{archive}: not the CIFAR-10 python archive (no {missing[0]})")


def _copy_files(directory: Path, into: Path) -> None:
    for name in REQUIRED_FILES:
        try:
            shutil.copyfile(directory / name, into / name)
        except FileNotFoundError:
            raise DatasetImportError(f"{directory / name}: missing (a {CIFAR10_DIR} directory has "
                                     f"{', '.join(REQUIRED_FILES)})") from None


@dataclass(frozen=True)
class Imported:
    directory: Path
    manifest: Manifest
    seconds: float


def import_cifar10(source: Path | None, data_dir: str | Path, *, download: bool = False,
                   block_samples: int = DEFAULT_BLOCK_SAMPLES) -> Imported:
    """Place CIFAR-10 from `source` (archive or directory; None with `download`: fetch it with
    torchvision) under `data_dir`, check it and write its manifest. An earlier copy there is
    replaced only once the new one passed every check."""
    started = time.perf_counter()
    data_dir = Path(data_dir)
    target = data_dir / CIFAR10_DIR
    data_dir.mkdir(parents=True, exist_ok=True)
    if (source is None) == (not download):
        raise DatasetImportError("give the path of cifar-10-python.tar.gz (or of its extracted "
                                 f"{CIFAR10_DIR} directory), or --download, not both")
    if download:
        from torchvision.datasets import CIFAR10 as TorchCIFAR10  # imported on use: seconds

        try:  # torchvision checks the archive's md5 sum and unpacks it into data_dir
            TorchCIFAR10(root=str(data_dir), train=True, download=True)
        except Exception as e:  # noqa: BLE001 - offline, refused, or a damaged download: one line
            raise DatasetImportError(f"downloading CIFAR-10 into {data_dir} failed ({type(e).__name__}: {e}); "
                                     "fetch cifar-10-python.tar.gz where there is internet and import that "
                                     "file") from None
        source = target
    source = Path(source)
    if not source.exists():
        raise DatasetImportError(f"{source}: no such file or directory")
    if source.is_dir() and source.resolve() == target.resolve():  # in place: check and describe only
        manifest = build_manifest(target, block_samples=block_samples, official=is_official(target),
                                  extra={"source": str(source.resolve()), "imported_at": time.time()})
        _write_manifest(target, manifest)
        return Imported(target, manifest, time.perf_counter() - started)
    staging = Path(tempfile.mkdtemp(prefix=".cifar10-import-", dir=data_dir))
    try:
        if source.is_dir():
            _copy_files(source, staging)
        else:
            _extract(source, staging)
        manifest = build_manifest(staging, block_samples=block_samples, official=is_official(staging),
                                  extra={"source": str(source.resolve()), "imported_at": time.time()})
        _write_manifest(staging, manifest)
        if target.exists():
            old = data_dir / f".cifar10-replaced-{staging.name}"
            target.rename(old)
            shutil.rmtree(old)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Imported(target, manifest, time.perf_counter() - started)


def _write_manifest(directory: Path, manifest: Manifest) -> None:
    path = directory / MANIFEST_FILE
    partial = path.with_suffix(".partial")
    partial.write_text(manifest.to_json())
    partial.replace(path)


# --- the `edgetrain data` command -----------------------------------------------------------------

def add_data_arguments(data: argparse.ArgumentParser) -> None:
    """`edgetrain data import cifar10 PATH [--data-dir DIR] [--download]`."""
    sub = data.add_subparsers(dest="data_command", required=True)
    cmd = sub.add_parser("import", help="check CIFAR-10 and place it under the gateway's data directory, "
                                        "from where the coordinator serves boards the samples they need")
    cmd.add_argument("dataset", choices=(CIFAR10,), help="the dataset (cifar10)")
    cmd.add_argument("path", nargs="?", type=Path, default=None,
                     help=f"cifar-10-python.tar.gz, or its extracted {CIFAR10_DIR} directory")
    cmd.add_argument("--data-dir", type=Path, default=Path("data"),
                     help="the gateway's data directory (the coordinator's --data-dir; default: data)")
    cmd.add_argument("--download", action="store_true", help="download the archive first (needs internet)")
    cmd.add_argument("--block-samples", type=int, default=DEFAULT_BLOCK_SAMPLES,
                     help=f"samples per block boards fetch and check (default {DEFAULT_BLOCK_SAMPLES})")


def run_data_command(args: argparse.Namespace) -> int:
    """`edgetrain data import`: one summary line, or one error line and exit code 2."""
    try:
        imported = import_cifar10(args.path, args.data_dir, download=args.download,
                                  block_samples=args.block_samples)
    except DatasetImportError as e:
        print(f"edgetrain data import: error: {e}", file=sys.stderr)
        return 2
    manifest = imported.manifest
    sizes = " + ".join(f"{s.samples} {name}" for name, s in manifest.splits.items())
    blocks = sum(len(s.blocks) for s in manifest.splits.values())
    print(f"CIFAR-10 imported into {imported.directory} in {imported.seconds:.1f} s: {sizes} images, "
          f"{blocks} blocks of up to {manifest.block_samples} samples (sha256 in {MANIFEST_FILE}); "
          f"a coordinator started with --data-dir {args.data_dir} serves them to its boards")
    if not manifest.official:
        print("note: these files are not the official CIFAR-10 release (their md5 sums differ); torchvision's "
              "loader, which the coordinator evaluates with, refuses them", file=sys.stderr)
    return 0

