"""Image folders (torchvision's ``ImageFolder`` convention) decoded once into 32x32 uint8 arrays.

A folder holds one sub-folder per class, named for it, with the class's images anywhere below
(JPEG, PNG, BMP, GIF, TIFF, WebP, PPM/PGM; other files are ignored). Either the folder itself is
split that way, or it holds ``train/`` and ``test/`` split that way (as CINIC-10 ships; other
sub-folders such as ``valid/`` are then ignored); without ``test/``, a held-out fraction of each
class, chosen by a seed, is the test split. Classes are the sorted sub-folder names; a test
class must be a training class.

Each image is decoded with Pillow (a JPEG at the smallest scale that still covers 32x32, which is
most of the speed), converted to RGB, centre-cropped to a square and resized to 32x32 — the input
of the CIFAR model variants — and kept as channel-major uint8, the layout CIFAR-10 uses. Splits
are shuffled by the seed, so a job that trains on "the first N" samples sees every class.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from edgetrain.datastore import IMAGE_BYTES, DatasetImportError, check_classes

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
"""File endings read as images (case-insensitive), as torchvision's ImageFolder reads them."""
DEFAULT_TEST_FRACTION = 0.1
"""Held out of each class for the test split when the folder has no test/ sub-folder."""
SIDE = 32


@dataclass(frozen=True)
class BadImage:
    """An image file that could not be used, and why (one line)."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


class UnreadableImages(DatasetImportError):
    """Some image files could not be decoded; `bad` names each of them."""

    def __init__(self, bad: list[BadImage], total: int) -> None:
        super().__init__(f"{len(bad)} of {total} image files could not be decoded (each named above); fix or remove "
                         "them, or import the rest with --skip-bad")
        self.bad = bad


@dataclass(frozen=True)
class ClassFolders:
    """The images of one split, by class."""

    root: Path
    classes: tuple[str, ...]
    files: tuple[tuple[Path, int], ...]
    """(image file, class index), sorted by class then path."""


def _listdir(directory: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as entries:
            return sorted((e for e in entries if not e.name.startswith(".")), key=lambda e: e.name)
    except FileNotFoundError:
        raise DatasetImportError(f"{directory}: no such directory") from None
    except NotADirectoryError:
        raise DatasetImportError(f"{directory}: not a directory (an image folder holds one sub-folder per "
                                 "class)") from None
    except PermissionError:
        raise DatasetImportError(f"{directory}: cannot read it (permission denied)") from None
    except OSError as e:
        raise DatasetImportError(f"{directory}: cannot read it ({e.strerror})") from None


def _images_below(directory: Path) -> Iterator[Path]:
    for entry in _listdir(directory):
        if entry.is_dir():
            yield from _images_below(Path(entry.path))
        elif entry.is_file() and entry.name.lower().endswith(IMAGE_EXTENSIONS):
            yield Path(entry.path)


def scan_classes(root: str | Path, *, min_classes: int = 2) -> ClassFolders:
    """The class sub-folders of `root` and their image files (DatasetImportError, one line, when
    `root` cannot be read, has fewer than `min_classes` classes or a class folder has no image)."""
    root = Path(root)
    classes = [e.name for e in _listdir(root) if e.is_dir()]
    if len(classes) < min_classes:
        stray = sum(1 for e in _listdir(root) if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS))
        hint = f" ({stray} images lie in it directly: put each class's images in a sub-folder named for it)" \
            if stray else ""
        found = f"one class folder ({classes[0]!r})" if len(classes) == 1 else f"{len(classes)} class folders"
        raise DatasetImportError(f"{root}: {found}; an image folder needs at least {min_classes} (one sub-folder "
                                 f"per class){hint}")
    files = []
    for index, name in enumerate(classes):
        images = list(_images_below(root / name))
        if not images:
            raise DatasetImportError(f"{root / name}: class folder without images ({', '.join(IMAGE_EXTENSIONS)})")
        files += [(path, index) for path in images]
    return ClassFolders(root, check_classes(classes, str(root), min_classes=min_classes), tuple(files))


def decode_image(path: Path):
    """The uint8 (3072,) channel-major 32x32 RGB image of the file at `path` (OSError/ValueError
    when it cannot be decoded)."""
    import numpy as np
    from PIL import Image, ImageOps

    with Image.open(path) as image:
        image.draft("RGB", (SIDE, SIDE))  # a JPEG decodes at 1/2-1/8 scale when that still covers 32x32
        if image.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N"):  # 16-bit grey: Pillow's convert clips it
            image = Image.fromarray((np.asarray(image).astype(np.uint32) >> 8).clip(0, 255).astype(np.uint8))
        image = ImageOps.fit(image.convert("RGB"), (SIDE, SIDE), Image.Resampling.BILINEAR)
        pixels = np.asarray(image, dtype=np.uint8)
    return pixels.transpose(2, 0, 1).reshape(IMAGE_BYTES)


def decode_files(files: tuple[tuple[Path, int], ...], *, skip_bad: bool = False):
    """(uint8 (N, 3072) images, uint8 (N,) labels, bad files) of `files`. A file that cannot be
    decoded is left out when `skip_bad`, else UnreadableImages names every such file."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    images = np.empty((len(files), IMAGE_BYTES), dtype=np.uint8)
    labels = np.empty(len(files), dtype=np.uint8)
    bad: list[BadImage] = []
    count = 0
    for path, label in files:
        try:
            images[count] = decode_image(path)
        except UnidentifiedImageError:
            bad.append(BadImage(path, "not an image Pillow can read"))
            continue
        except Image.DecompressionBombError as e:  # a header claiming far more pixels than a photo has
            bad.append(BadImage(path, f"refused: {e}"))
            continue
        except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt data, unreadable file
            bad.append(BadImage(path, f"cannot decode it ({type(e).__name__}: {e})"))
            continue
        labels[count] = label
        count += 1
    if bad and not skip_bad:
        raise UnreadableImages(bad, len(files))
    return images[:count], labels[:count], bad


@dataclass(frozen=True)
class DecodedFolder:
    """An image folder decoded: its classes and splits, and the files left out."""

    classes: tuple[str, ...]
    splits: dict
    """{"train": (images, labels), "test": (images, labels)}; uint8 (N, 3072) and (N,)."""
    bad: tuple[BadImage, ...]
    layout: str
    """How the splits were found: "train/ and test/" or "held out: F of each class"."""


def decode_image_folder(root: str | Path, *, test_fraction: float = DEFAULT_TEST_FRACTION, seed: int = 0,
                        skip_bad: bool = False) -> DecodedFolder:
    """Decode the image folder at `root` into shuffled train and test splits (module docstring)."""
    root = Path(root)
    if not 0.0 < test_fraction < 1.0:
        raise DatasetImportError(f"--test-fraction must be in (0, 1), got {test_fraction}")
    if (root / "train").is_dir():
        train = scan_classes(root / "train")
        if (root / "test").is_dir():
            test = scan_classes(root / "test", min_classes=1)
            unknown = sorted(set(test.classes) - set(train.classes))
            if unknown:
                raise DatasetImportError(f"{root / 'test' / unknown[0]}: test class {unknown[0]!r} has no training "
                                         f"folder in {root / 'train'}")
            index = {name: i for i, name in enumerate(train.classes)}
            test_files = tuple((path, index[test.classes[label]]) for path, label in test.files)
            return _decoded(train.classes, train.files, test_files, seed, skip_bad, "train/ and test/")
        return _held_out(train, test_fraction, seed, skip_bad)
    return _held_out(scan_classes(root), test_fraction, seed, skip_bad)


def _held_out(folders: ClassFolders, fraction: float, seed: int, skip_bad: bool) -> DecodedFolder:
    rng = random.Random(f"held-out:{seed}")
    train, test = [], []
    by_class: dict[int, list[tuple[Path, int]]] = {}
    for entry in folders.files:
        by_class.setdefault(entry[1], []).append(entry)
    for index in range(len(folders.classes)):
        members = by_class[index]
        rng.shuffle(members)
        held = min(len(members) - 1, max(1, round(fraction * len(members)))) if len(members) > 1 else 0
        test += members[:held]
        train += members[held:]
    if not test:
        raise DatasetImportError(f"{folders.root}: too few images to hold any out for testing; add images or a "
                                 "test/ folder")
    return _decoded(folders.classes, tuple(train), tuple(test), seed, skip_bad,
                    f"held out: {fraction:g} of each class (seed {seed})")


def _decoded(classes, train_files, test_files, seed: int, skip_bad: bool, layout: str) -> DecodedFolder:
    bad: list[BadImage] = []
    splits = {}
    for split, files in (("train", train_files), ("test", test_files)):
        order = list(files)
        random.Random(f"{split}:{seed}").shuffle(order)  # "the first N samples" of a split holds every class
        try:
            images, labels, skipped = decode_files(tuple(order), skip_bad=skip_bad)
        except UnreadableImages as e:
            bad += e.bad
            continue
        bad += skipped
        if not len(labels):
            raise DatasetImportError(f"no {split} image could be decoded")
        splits[split] = (images, labels)
    if bad and not skip_bad:
        raise UnreadableImages(sorted(bad, key=lambda b: str(b.path)), len(train_files) + len(test_files))
    return DecodedFolder(tuple(classes), splits, tuple(bad), layout)


def write_image_folder(root: str | Path, images, labels, classes, *, fmt: str = "png", side: int | None = None,
                       quality: int = 90, stems=None) -> list[Path]:
    """Write uint8 (N, 3, H, W) `images` as an image folder under `root`: one sub-folder per class
    of `classes`, each image a `fmt` file ("png" or "jpeg"), resized to `side` x `side` when given,
    named by `stems` (default: its index). What an exported partition or a generated test set is."""
    import numpy as np
    from PIL import Image

    root = Path(root)
    for name in classes:
        (root / name).mkdir(parents=True, exist_ok=True)
    suffix = {"png": ".png", "jpeg": ".jpg"}[fmt]
    paths = []
    for i, (pixels, label) in enumerate(zip(images, labels)):
        image = Image.fromarray(np.ascontiguousarray(np.asarray(pixels, dtype=np.uint8).transpose(1, 2, 0)))
        if side is not None:
            image = image.resize((side, side), Image.Resampling.BILINEAR)
        path = root / classes[int(label)] / f"{stems[i] if stems is not None else i:06}{suffix}"
        image.save(path, **({"quality": quality} if fmt == "jpeg" else {}))
        paths.append(path)
    return paths
