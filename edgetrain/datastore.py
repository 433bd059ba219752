"""Imported datasets as EdgeTrain keeps them: 32x32 uint8 images in blocks with checksums.

Every dataset a gateway imports (`edgetrain data import`, edgetrain/dataset_import.py) and every
image folder a board keeps for itself (`edgetrain client --local-data`) is decoded once into a
**store**, a directory holding:

```
edgetrain-manifest.json    classes, each split's size, the sha256 of every block, where it came from
train.images  test.images  uint8 images, channel-major 3x32x32 each, one after the other
train.labels  test.labels  one uint8 label per image (an index into the manifest's classes)
```

so nothing on a training path decodes JPEG, and a board reads or fetches exactly the bytes the
gateway checked. The block format (a block's images, then its labels) is the one boards fetch
over the Datasets service (coordinator/data_service.py) and check against the manifest's sums;
CIFAR-10 imported in its own python format (`cifar-10-batches-py/`) is described by the same
manifest. Stores are written whole or not at all (a staging directory renamed into place).
Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

IMAGE_SHAPE = (3, 32, 32)
"""Shape of every stored image (channels, height, width): the input of the CIFAR model variants."""
IMAGE_BYTES = 3 * 32 * 32
MAX_CLASSES = 256
"""Labels are one byte each."""
MIN_CLASSES = 2
DEFAULT_BLOCK_SAMPLES = 1000
"""Samples per block: 3 MB, a few seconds on a slow board link; a board trained on the first 5000
samples of a split fetches 5 blocks."""
MANIFEST_FILE = "edgetrain-manifest.json"
MANIFEST_FORMAT = 2
"""Format 2 added the class names (format 1, CIFAR-10 only, is still read)."""
SPLITS = ("train", "test")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
"""CIFAR-10's class names, in label order (its batches.meta)."""
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")


class DatasetImportError(ValueError):
    """A dataset given (or found) is not usable; the message is one line naming the file."""


def check_dataset_name(name: str, *, reserved: tuple[str, ...] = ()) -> str:
    """`name` if it can name an imported dataset (lower-case letters, digits, '.', '_', '-'; at
    most 64; not one of `reserved`), else DatasetImportError."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise DatasetImportError(f"bad dataset name {name!r}: use 1-64 lower-case letters, digits, '.', '_' or '-', "
                                 "starting with a letter or digit")
    if name in reserved:
        raise DatasetImportError(f"dataset name {name!r} is taken by a built-in dataset; choose another --name")
    return name


def check_classes(classes, where: str, *, min_classes: int = MIN_CLASSES) -> tuple[str, ...]:
    """The class names as a tuple, checked: `min_classes` (2; a board's own data may hold 1) to 256
    distinct non-empty names."""
    classes = tuple(str(c) for c in classes)
    if not min_classes <= len(classes) <= MAX_CLASSES:
        found = f"one class ({classes[0]!r})" if len(classes) == 1 else f"{len(classes)} classes"
        raise DatasetImportError(f"{where}: {found}; a dataset needs {min_classes} to {MAX_CLASSES} classes")
    if len(set(classes)) != len(classes) or not all(classes):
        raise DatasetImportError(f"{where}: class names must be distinct and non-empty, got {list(classes)}")
    return classes


# --- blocks and the manifest ----------------------------------------------------------------------

def block_bytes(images, labels) -> bytes:
    """The bytes a block's sha256 covers: its images (uint8, in order) then its labels (one byte each)."""
    return images.tobytes() + labels.tobytes()


def block_sha256(images, labels) -> str:
    """Hex sha256 of a block (see block_bytes)."""
    return hashlib.sha256(block_bytes(images, labels)).hexdigest()


def block_sums(images, labels, block_samples: int) -> tuple[str, ...]:
    """The sha256 of each block of `block_samples` consecutive samples."""
    return tuple(block_sha256(images[start:start + block_samples], labels[start:start + block_samples])
                 for start in range(0, len(labels), block_samples))


@dataclass(frozen=True)
class SplitManifest:
    samples: int
    blocks: tuple[str, ...]
    """Hex sha256 of each block."""


@dataclass(frozen=True)
class Manifest:
    """What an imported dataset holds: class names, split sizes and the sha256 of each block."""

    dataset: str
    block_samples: int
    splits: dict[str, SplitManifest]
    official: bool = False
    """CIFAR-10 only: whether the files are byte for byte the official release (its md5 sums)."""
    extra: dict = field(default_factory=dict, compare=False)
    """Where it came from and when (kept in the file, not compared)."""
    classes: tuple[str, ...] = CIFAR10_CLASSES
    """Class names in label order."""

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
                           "classes": list(self.classes),
                           "splits": {name: {"samples": s.samples, "block_sha256": list(s.blocks)}
                                      for name, s in self.splits.items()}}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: Path) -> Manifest:
        try:
            data = json.loads(text)
            if data["format"] not in (1, MANIFEST_FORMAT):
                raise ValueError(f"format {data['format']}, this edgetrain reads 1 and {MANIFEST_FORMAT}")
            splits = {name: SplitManifest(int(s["samples"]), tuple(str(h) for h in s["block_sha256"]))
                      for name, s in data["splits"].items()}
            classes = tuple(str(c) for c in data["classes"]) if data["format"] >= 2 else CIFAR10_CLASSES
            known = {"format", "dataset", "block_samples", "official", "image_shape", "splits", "classes"}
            return cls(str(data["dataset"]), int(data["block_samples"]), splits, bool(data["official"]),
                       {k: v for k, v in data.items() if k not in known}, classes)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DatasetImportError(f"{where}: not an edgetrain dataset manifest ({e}); import the dataset "
                                     "again") from None


def read_manifest(directory: Path) -> Manifest | None:
    """The manifest in `directory` (None: there is none)."""
    path = Path(directory) / MANIFEST_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DatasetImportError(f"{path}: cannot read it ({e.strerror})") from None
    return Manifest.from_json(text, path)


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write `manifest` into `directory` (whole or not at all)."""
    path = Path(directory) / MANIFEST_FILE
    partial = path.with_suffix(".partial")
    partial.write_text(manifest.to_json())
    partial.replace(path)


# --- stores ---------------------------------------------------------------------------------------

def store_dir(data_dir: str | Path, name: str) -> Path:
    """Where the dataset `name` is stored under `data_dir`."""
    return Path(data_dir) / name


def make_data_dir(path: str | Path) -> Path:
    """`path`, created if missing (DatasetImportError, one line, when it cannot be a directory)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DatasetImportError(f"{path}: not a directory (the data directory must be one)") from None
    except OSError as e:
        raise DatasetImportError(f"{path}: cannot make the data directory there ({e.strerror})") from None
    return path


def write_store(directory: Path, name: str, splits: dict, classes, *, block_samples: int = DEFAULT_BLOCK_SAMPLES,
                extra: dict | None = None, min_classes: int = MIN_CLASSES) -> Manifest:
    """Store `splits` ({split: (uint8 (N, 3072) images, uint8 (N,) labels)}) with `classes` as the
    dataset `name` in `directory`, replacing what was there only once the new store is complete."""
    import numpy as np

    if block_samples <= 0:
        raise DatasetImportError(f"block size must be > 0 samples, got {block_samples}")
    classes = check_classes(classes, name, min_classes=min_classes)
    directory = Path(directory)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-import-", dir=make_data_dir(directory.parent)))
    staging.chmod(0o755)  # as a directory made by mkdir: a coordinator run by another user reads it
    try:
        entries = {}
        for split, (images, labels) in splits.items():
            images = np.ascontiguousarray(images, dtype=np.uint8).reshape(len(labels), IMAGE_BYTES)
            labels = np.ascontiguousarray(labels, dtype=np.uint8)
            (staging / f"{split}.images").write_bytes(images.tobytes())
            (staging / f"{split}.labels").write_bytes(labels.tobytes())
            entries[split] = SplitManifest(len(labels), block_sums(images, labels, block_samples))
        manifest = Manifest(name, block_samples, entries, extra={"imported_at": time.time(), **(extra or {})},
                            classes=classes)
        write_manifest(staging, manifest)
        _replace(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _replace(staging: Path, target: Path) -> None:
    """Move the complete `staging` directory to `target`, removing an older one there."""
    if target.exists():
        old = target.with_name(f".{target.name}-replaced-{os.getpid()}-{time.monotonic_ns()}")
        target.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    staging.rename(target)


def read_store_split(directory: Path, manifest: Manifest, split: str, *, verify: bool = True):
    """The (uint8 (N, 3072) images, uint8 (N,) labels) of `split` of the store in `directory`;
    with `verify`, every block is checked against the manifest first (DatasetImportError naming
    the block that changed)."""
    import numpy as np

    directory = Path(directory)
    if split not in manifest.splits:
        raise DatasetImportError(f"{directory}: the dataset has no {split} split (it has {', '.join(manifest.splits)})")
    entry = manifest.splits[split]
    try:
        images = np.fromfile(directory / f"{split}.images", dtype=np.uint8)
        labels = np.fromfile(directory / f"{split}.labels", dtype=np.uint8)
    except FileNotFoundError as e:
        raise DatasetImportError(f"{e.filename}: missing; import the dataset again") from None
    except OSError as e:
        raise DatasetImportError(f"{e.filename}: cannot read it ({e.strerror})") from None
    if labels.size != entry.samples or images.size != entry.samples * IMAGE_BYTES:
        raise DatasetImportError(f"{directory}: the {split} split holds {labels.size} labels and "
                                 f"{images.size // IMAGE_BYTES} images where its manifest says {entry.samples}; "
                                 "import the dataset again")
    images = images.reshape(entry.samples, IMAGE_BYTES)
    if verify:
        verify_blocks(manifest, split, images, labels, where=directory)
    if labels.size and int(labels.max()) >= len(manifest.classes):
        raise DatasetImportError(f"{directory}: label {int(labels.max())} in the {split} split, but the dataset has "
                                 f"{len(manifest.classes)} classes")
    return images, labels


def verify_blocks(manifest: Manifest, split: str, images, labels, *, where: Path) -> None:
    """DatasetImportError unless every block of `split` matches its sha256 in `manifest`."""
    size = manifest.block_samples
    for index, expected in enumerate(manifest.splits[split].blocks):
        start = index * size
        if block_sha256(images[start:start + size], labels[start:start + size]) != expected:
            raise DatasetImportError(f"{where}: block {index} of the {split} split no longer matches its "
                                     "manifest (changed or damaged since its import); import the dataset again")


def stored_datasets(data_dir: str | Path) -> dict[str, Manifest]:
    """The datasets stored under `data_dir`, by name (unreadable ones left out)."""
    out = {}
    root = Path(data_dir)
    if not root.is_dir():
        return out
    for child in sorted(root.iterdir()):
        if child.is_dir() and not child.name.startswith("."):
            try:
                manifest = read_manifest(child)
            except DatasetImportError:
                continue
            if manifest is not None:
                out[manifest.dataset] = manifest
    return out
