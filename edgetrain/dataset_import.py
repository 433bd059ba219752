"""`edgetrain data`: datasets imported once on the gateway, checked, and described block by block.

- ``import cifar10 PATH`` (or ``--download``): the official CIFAR-10 python release
  (``cifar-10-python.tar.gz`` or its extracted ``cifar-10-batches-py/``), placed under
  ``DATA_DIR/cifar-10-batches-py`` where a board with its own copy keeps it too; its md5 sums are
  checked against the official ones and the import says whether they match.
- ``import cifar PATH --name NAME``: any set in CIFAR-10's python layout — any number of
  ``data_batch_*`` files, a ``test_batch`` and a ``batches.meta`` naming its own classes —
  read with EdgeTrain's own reader (never torchvision's md5-checked one) into a store.
- ``import imagefolder DIR --name NAME``: a folder of images, one sub-folder per class
  (edgetrain/image_folder.py), decoded once into a store.
- ``list``: what is imported under the data directory.

A store (edgetrain/datastore.py) and the CIFAR-10 directory both carry a manifest: class names,
each split's size and the sha256 of each block of ``block_samples`` samples. The coordinator's
Datasets service (coordinator/data_service.py) serves those blocks to boards, which check each
against the manifest (edge_client/dataset.py). Batch files are unpickled with an unpickler that
admits numpy arrays and plain containers only. Nothing here imports torch or numpy at module
level: `edgetrain --help` stays fast.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import logging
import pickle
import re
import shutil
import sys
import tarfile
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgetrain.datastore import (
    DEFAULT_BLOCK_SAMPLES,
    IMAGE_BYTES,
    IMAGE_SHAPE,
    MANIFEST_FILE,
    DatasetImportError,
    Manifest,
    SplitManifest,
    block_sha256,
    block_sums,
    check_classes,
    check_dataset_name,
    make_data_dir,
    read_manifest,
    read_store_split,
    store_dir,
    stored_datasets,
    verify_blocks,
    write_manifest,
    write_store,
)

__all__ = ["CIFAR10", "CIFAR10_DIR", "IMAGE_BYTES", "IMAGE_SHAPE", "MANIFEST_FILE", "DatasetImportError",
           "Manifest", "SplitManifest", "block_sha256", "import_cifar10", "load_manifest", "read_split"]

logger = logging.getLogger(__name__)

CIFAR10 = "cifar10"
"""The dataset name jobs and the Datasets service use for CIFAR-10."""
CIFAR10_DIR = "cifar-10-batches-py"
"""The directory the archive unpacks to, and where CIFAR-10 is placed under a data directory."""
BUILT_IN = ("synthetic", "synthetic-hard", CIFAR10)
"""Names an imported dataset cannot take."""
SPLIT_FILES: dict[str, tuple[str, ...]] = {
    "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
    "test": ("test_batch",),
}
"""The batch files of each split of CIFAR-10, in sample order."""
META_FILE = "batches.meta"
NUM_CLASSES = 10
_TRAIN_BATCH = re.compile(r"data_batch_(\d+)")


def import_command(dataset: str = CIFAR10, data_dir: str | Path = "data") -> str:
    """The command that places `dataset` on a gateway whose data directory is `data_dir`."""
    if dataset == CIFAR10:
        return f"edgetrain data import cifar10 cifar-10-python.tar.gz --data-dir {data_dir}"
    return f"edgetrain data import imagefolder DIR --name {dataset} --data-dir {data_dir}"


# --- reading batch files --------------------------------------------------------------------------

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
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a CIFAR python batch never does")
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
        raise DatasetImportError(f"{path}: not a CIFAR python batch ({type(e).__name__}: {e})") from None


def _text_keys(entry: dict) -> dict:
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in entry.items()}


def read_batch(path: Path, num_classes: int = NUM_CLASSES):
    """The (uint8 (N, 3072) images, uint8 (N,) labels) of one CIFAR python batch file, checked
    (labels in 0..num_classes - 1)."""
    import numpy as np

    entry = _unpickle(path)
    if not isinstance(entry, dict):
        raise DatasetImportError(f"{path}: not a CIFAR python batch (a {type(entry).__name__}, not a dict)")
    entry = _text_keys(entry)
    for key in ("data", "labels"):
        if key not in entry:
            raise DatasetImportError(f"{path}: not a CIFAR python batch (no {key!r} key)")
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
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DatasetImportError(f"{path}: labels must be in 0..{num_classes - 1} (its batches.meta names "
                                 f"{num_classes} classes), found {labels.min()}..{labels.max()}")
    return np.ascontiguousarray(images), labels.astype(np.uint8)


def read_classes(directory: Path) -> tuple[str, ...]:
    """The class names that `batches.meta` in `directory` lists (`label_names`)."""
    path = directory / META_FILE
    meta = _unpickle(path)
    names = _text_keys(meta).get("label_names") if isinstance(meta, dict) else None
    if not isinstance(names, list):
        raise DatasetImportError(f"{path}: needs 'label_names', the list of class names")
    names = [n.decode("latin1") if isinstance(n, bytes) else n for n in names]
    return check_classes(names, str(path))


def training_batches(directory: Path) -> tuple[str, ...]:
    """The `data_batch_<n>` files in `directory`, by n."""
    found = sorted((int(m.group(1)), p.name) for p in directory.iterdir()
                   if p.is_file() and (m := _TRAIN_BATCH.fullmatch(p.name)))
    if not found:
        raise DatasetImportError(f"{directory}: no data_batch_* file (a CIFAR python set has data_batch_1.., "
                                 "test_batch and batches.meta)")
    return tuple(name for _, name in found)


def read_split(directory: Path, split: str, num_classes: int = NUM_CLASSES, files: tuple[str, ...] | None = None):
    """The (images, labels) of a whole split: its batch files concatenated in order (CIFAR-10's
    unless `files` are given)."""
    import numpy as np

    parts = [read_batch(directory / name, num_classes) for name in (files or SPLIT_FILES[split])]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def dataset_dir(data_dir: str | Path, name: str) -> Path:
    """Where the dataset `name` is imported under `data_dir`: CIFAR-10's own directory, or a store."""
    return Path(data_dir) / CIFAR10_DIR if name == CIFAR10 else store_dir(data_dir, name)


def read_imported_split(directory: Path, manifest: Manifest, split: str):
    """The (uint8 (N, 3072) images, uint8 (N,) labels) of `split` of the dataset imported in
    `directory` (CIFAR-10's batch files or a store), every block checked against `manifest`
    (DatasetImportError when one changed since the import)."""
    if manifest.dataset != CIFAR10:
        return read_store_split(directory, manifest, split)
    images, labels = read_split(directory, split)
    if len(labels) != manifest.splits[split].samples:
        raise DatasetImportError(f"{directory}: holds {len(labels)} {split} samples where its manifest says "
                                 f"{manifest.splits[split].samples}; import it again")
    verify_blocks(manifest, split, images, labels, where=directory)
    return images, labels


def load_manifest(data_dir: str | Path) -> Manifest | None:
    """The manifest of the CIFAR-10 imported under `data_dir` (None: none imported there)."""
    return read_manifest(Path(data_dir) / CIFAR10_DIR)


OFFICIAL_MD5 = {
    "data_batch_1": "c99cafc152244af753f735de768cd75f", "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
    "data_batch_3": "54ebc095f3ab1f0389bbae665268c751", "data_batch_4": "634d18415352ddfa80567beed471001a",
    "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb", "test_batch": "40351d587109b95175f43aff81a1287e",
    "batches.meta": "5ff9c542aee3614f3951f8cda6e48888",
}
"""md5 sums of the official release's files (as torchvision/datasets/cifar.py lists them)."""


def is_official(directory: Path) -> bool:
    """Whether every file is the official CIFAR-10 release's."""
    return all(hashlib.md5((directory / name).read_bytes(), usedforsecurity=False).hexdigest() == md5
               for name, md5 in OFFICIAL_MD5.items())


def build_manifest(directory: Path, *, block_samples: int = DEFAULT_BLOCK_SAMPLES,
                   official: bool = False, extra: dict | None = None) -> Manifest:
    """Check every file of the CIFAR-10 directory and describe its blocks."""
    if block_samples <= 0:
        raise DatasetImportError(f"block size must be > 0 samples, got {block_samples}")
    classes = read_classes(directory)
    if len(classes) != NUM_CLASSES:
        raise DatasetImportError(f"{directory / META_FILE}: names {len(classes)} classes, CIFAR-10 has "
                                 f"{NUM_CLASSES}; import a set of your own with `edgetrain data import cifar PATH "
                                 "--name NAME`")
    splits = {}
    for split in SPLIT_FILES:
        images, labels = read_split(directory, split)
        splits[split] = SplitManifest(len(labels), block_sums(images, labels, block_samples))
    return Manifest(CIFAR10, block_samples, splits, official, extra or {}, classes)


# --- placing the files ----------------------------------------------------------------------------

REQUIRED_FILES = (*SPLIT_FILES["train"], *SPLIT_FILES["test"], META_FILE)


def _cifar_member(name: str) -> bool:
    return name in ("test_batch", META_FILE) or bool(_TRAIN_BATCH.fullmatch(name))


def _extract(archive: Path, into: Path, *, top: str | None) -> None:
    """Copy the CIFAR python files out of `archive` into `into` (only those, and only under the
    directory `top` when given: no path the archive names is trusted)."""
    directories: set[str] = set()
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                path = Path(member.name)
                if not member.isfile() or not _cifar_member(path.name) or (top and str(path.parent) != top):
                    continue
                directories.add(str(path.parent))
                if len(directories) > 1:
                    raise DatasetImportError(f"{archive}: holds CIFAR python files in more than one directory "
                                             f"({', '.join(sorted(directories))})")
                with tar.extractfile(member) as source, open(into / path.name, "wb") as out:
                    shutil.copyfileobj(source, out)
    except FileNotFoundError:
        raise DatasetImportError(f"{archive}: no such file") from None
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise DatasetImportError(f"{archive}: truncated or not a tar archive ({e})") from None
    wanted = REQUIRED_FILES if top else ("test_batch", META_FILE)
    missing = [name for name in wanted if not (into / name).exists()]
    if missing:
        where = f"{top}/{missing[0]}" if top else missing[0]
        raise DatasetImportError(f"{archive}: not a CIFAR{'-10' if top else ''} python archive (no {where})")


def _copy_files(directory: Path, into: Path, names: tuple[str, ...]) -> None:
    for name in names:
        try:
            shutil.copyfile(directory / name, into / name)
        except FileNotFoundError:
            raise DatasetImportError(f"{directory / name}: missing (a CIFAR python directory has "
                                     f"{', '.join(names)})") from None
        except OSError as e:
            raise DatasetImportError(f"{directory / name}: cannot read it ({e.strerror})") from None


@dataclass(frozen=True)
class Imported:
    directory: Path
    manifest: Manifest
    seconds: float
    notes: tuple[str, ...] = ()
    """Lines to tell the user besides the summary (files left out, how splits were found)."""


def import_cifar10(source: Path | None, data_dir: str | Path, *, download: bool = False,
                   block_samples: int = DEFAULT_BLOCK_SAMPLES) -> Imported:
    """Place CIFAR-10 from `source` (archive or directory; None with `download`: fetch it with
    torchvision) under `data_dir`, check it and write its manifest. An earlier copy there is
    replaced only once the new one passed every check."""
    started = time.perf_counter()
    data_dir = make_data_dir(data_dir)
    target = data_dir / CIFAR10_DIR
    if (source is None) == (not download):
        raise DatasetImportError("give the path of cifar-10-python.tar.gz (or of its extracted "
                                 f"{CIFAR10_DIR} directory), or --download, not both")
    if download:
        try:
            from torchvision.datasets import CIFAR10 as TorchCIFAR10  # imported on use: seconds
        except ImportError:
            raise DatasetImportError("--download needs torchvision, which only the gateway installs: "
                                     "pip install 'edgetrain[gateway]' (or import a downloaded archive)") from None
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
    extra = {"source": str(source.resolve()), "imported_at": time.time()}
    if source.is_dir() and source.resolve() == target.resolve():  # in place: check and describe only
        manifest = build_manifest(target, block_samples=block_samples, official=is_official(target), extra=extra)
        write_manifest(target, manifest)
        return Imported(target, manifest, time.perf_counter() - started)
    staging = Path(tempfile.mkdtemp(prefix=".cifar10-import-", dir=data_dir))
    try:
        if source.is_dir():
            _copy_files(source, staging, REQUIRED_FILES)
        else:
            _extract(source, staging, top=CIFAR10_DIR)
        manifest = build_manifest(staging, block_samples=block_samples, official=is_official(staging), extra=extra)
        write_manifest(staging, manifest)
        if target.exists():
            old = data_dir / f".cifar10-replaced-{staging.name}"
            target.rename(old)
            shutil.rmtree(old)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Imported(target, manifest, time.perf_counter() - started)


def import_cifar_format(source: Path, data_dir: str | Path, name: str, *,
                        block_samples: int = DEFAULT_BLOCK_SAMPLES) -> Imported:
    """Store a set in CIFAR-10's python layout (any number of training batches, its own classes)
    from `source` (an archive or a directory) as the dataset `name` under `data_dir`."""
    started = time.perf_counter()
    check_dataset_name(name, reserved=BUILT_IN)
    source = Path(source)
    if not source.exists():
        raise DatasetImportError(f"{source}: no such file or directory")
    with tempfile.TemporaryDirectory(prefix=".cifar-read-", dir=make_data_dir(data_dir)) as staging:
        directory = Path(staging)
        if source.is_dir():
            directory = source
        else:
            _extract(source, directory, top=None)
        try:
            classes = read_classes(directory)
            batches = training_batches(directory)
            splits = {"train": read_split(directory, "train", len(classes), batches),
                      "test": read_split(directory, "test", len(classes), ("test_batch",))}
        except DatasetImportError as e:  # name the file in the archive, not where it was unpacked
            raise DatasetImportError(str(e).replace(f"{staging}/", f"{source}: ").replace(staging, str(source))) \
                from None
    manifest = write_store(store_dir(data_dir, name), name, splits, classes, block_samples=block_samples,
                           extra={"kind": "cifar", "source": str(source.resolve())})
    note = f"{len(batches)} training batch files ({', '.join(batches)}) and test_batch, read with EdgeTrain's reader"
    return Imported(store_dir(data_dir, name), manifest, time.perf_counter() - started, (note,))


def import_image_folder(source: Path, data_dir: str | Path, name: str, *, block_samples: int = DEFAULT_BLOCK_SAMPLES,
                        test_fraction: float = 0.1, seed: int = 0, skip_bad: bool = False) -> Imported:
    """Decode the image folder `source` (edgetrain/image_folder.py) and store it as `name`."""
    from edgetrain.image_folder import decode_image_folder

    started = time.perf_counter()
    check_dataset_name(name, reserved=BUILT_IN)
    decoded = decode_image_folder(source, test_fraction=test_fraction, seed=seed, skip_bad=skip_bad)
    manifest = write_store(store_dir(data_dir, name), name, decoded.splits, decoded.classes,
                           block_samples=block_samples,
                           extra={"kind": "imagefolder", "source": str(Path(source).resolve()),
                                  "layout": decoded.layout, "skipped": [str(b) for b in decoded.bad]})
    notes = tuple(f"skipped {b}" for b in decoded.bad) + (f"splits: {decoded.layout}",)
    return Imported(store_dir(data_dir, name), manifest, time.perf_counter() - started, notes)


# --- the `edgetrain data` command -----------------------------------------------------------------

def add_data_arguments(data: argparse.ArgumentParser) -> None:
    """`edgetrain data import {cifar10,cifar,imagefolder} PATH ...` and `edgetrain data list`."""
    sub = data.add_subparsers(dest="data_command", required=True)
    cmd = sub.add_parser("import", help="check a dataset and store it under the gateway's data directory, "
                                        "from where the coordinator serves boards the samples they need")
    cmd.add_argument("dataset", choices=(CIFAR10, "cifar", "imagefolder"),
                     help="cifar10: the official CIFAR-10 python release; cifar: any set in its python layout; "
                          "imagefolder: a folder with one sub-folder of images per class")
    cmd.add_argument("path", nargs="?", type=Path, default=None,
                     help=f"the archive or directory (cifar10: cifar-10-python.tar.gz or {CIFAR10_DIR}/)")
    cmd.add_argument("--name", help="the name jobs give the dataset (`dataset: {name: NAME}`); cifar and "
                                    "imagefolder only")
    cmd.add_argument("--data-dir", type=Path, default=Path("data"),
                     help="the gateway's data directory (the coordinator's --data-dir; default: data)")
    cmd.add_argument("--download", action="store_true", help="cifar10: download the archive first (needs internet)")
    cmd.add_argument("--block-samples", type=int, default=DEFAULT_BLOCK_SAMPLES,
                     help=f"samples per block boards fetch and check (default {DEFAULT_BLOCK_SAMPLES})")
    cmd.add_argument("--test-fraction", type=float, default=0.1,
                     help="imagefolder without test/: the fraction of each class held out for testing (default 0.1)")
    cmd.add_argument("--seed", type=int, default=0, help="imagefolder: the seed of the held-out choice and of the "
                                                         "sample order (default 0)")
    cmd.add_argument("--skip-bad", action="store_true",
                     help="imagefolder: leave out images that cannot be decoded (each named) instead of stopping")
    listing = sub.add_parser("list", help="the datasets imported under a data directory")
    listing.add_argument("--data-dir", type=Path, default=Path("data"), help="the data directory (default: data)")


def _import(args: argparse.Namespace) -> Imported:
    if args.dataset == CIFAR10:
        if args.name not in (None, CIFAR10):
            raise DatasetImportError(f"cifar10 is always named cifar10; import another set in its layout with "
                                     f"`edgetrain data import cifar PATH --name {args.name}`")
        return import_cifar10(args.path, args.data_dir, download=args.download, block_samples=args.block_samples)
    if args.download:
        raise DatasetImportError("--download fetches CIFAR-10 only")
    if args.path is None or not args.name:
        raise DatasetImportError(f"give the path and --name: edgetrain data import {args.dataset} PATH --name NAME")
    if args.dataset == "cifar":
        return import_cifar_format(args.path, args.data_dir, args.name, block_samples=args.block_samples)
    return import_image_folder(args.path, args.data_dir, args.name, block_samples=args.block_samples,
                               test_fraction=args.test_fraction, seed=args.seed, skip_bad=args.skip_bad)


def run_data_command(args: argparse.Namespace) -> int:
    """`edgetrain data import` / `list`: summary lines, or error lines (one per problem) and exit code 2."""
    from edgetrain.image_folder import UnreadableImages

    if args.data_command == "list":
        return _list(args.data_dir)
    try:
        imported = _import(args)
    except UnreadableImages as e:
        for bad in e.bad:
            print(f"edgetrain data import: error: {bad}", file=sys.stderr)
        print(f"edgetrain data import: error: {e}; nothing was written", file=sys.stderr)
        return 2
    except DatasetImportError as e:
        print(f"edgetrain data import: error: {e}", file=sys.stderr)
        return 2
    manifest = imported.manifest
    for note in imported.notes:
        print(f"note: {note}", file=sys.stderr)
    sizes = " + ".join(f"{s.samples} {name}" for name, s in manifest.splits.items())
    blocks = sum(len(s.blocks) for s in manifest.splits.values())
    what = "CIFAR-10" if manifest.dataset == CIFAR10 else repr(manifest.dataset)
    print(f"{what} imported into {imported.directory} in {imported.seconds:.1f} s: {sizes} images of "
          f"{len(manifest.classes)} classes, {blocks} blocks of up to {manifest.block_samples} samples (sha256 in "
          f"{MANIFEST_FILE}); jobs name it `dataset: {{name: {manifest.dataset}}}`, and a coordinator started with "
          f"--data-dir {args.data_dir} serves it to its boards")
    if manifest.dataset == CIFAR10:
        if manifest.official:
            print("the files are the official CIFAR-10 release (every md5 sum matches)")
        else:
            print("note: these files are not the official CIFAR-10 release (their md5 sums differ); EdgeTrain "
                  "trains on them with its own reader, but results are not CIFAR-10's: import a set of your own "
                  "under its own name with `edgetrain data import cifar PATH --name NAME`", file=sys.stderr)
    return 0


def _list(data_dir: Path) -> int:
    found = stored_datasets(data_dir)
    cifar = load_manifest(data_dir) if (Path(data_dir) / CIFAR10_DIR).is_dir() else None
    if cifar is not None:
        found[CIFAR10] = cifar
    if not found:
        print(f"no dataset imported under {data_dir}")
        return 0
    for name, manifest in sorted(found.items()):
        sizes = ", ".join(f"{s.samples} {split}" for split, s in manifest.splits.items())
        classes = ", ".join(manifest.classes[:6]) + (", ..." if len(manifest.classes) > 6 else "")
        print(f"{name}: {sizes}; {len(manifest.classes)} classes ({classes})")
    return 0
