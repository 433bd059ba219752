"""A lab's own dataset imported on the gateway: `edgetrain data import imagefolder|cifar` and
`edgetrain data list`, run in-process through `edgetrain.cli.main`.

Every image is a real PNG or JPEG file written here with Pillow (several sizes, RGB, grayscale and
RGBA), every CIFAR-format set a real pickled batch file (the keys and dtypes of the CIFAR-10 python
release) in a real .tar.gz, so the importer decodes exactly what a user would give it. Classes are
solid colours where the test must tell which stored sample came from which folder.
"""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import os
import pickle
import shutil
import struct
import tarfile
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from edgetrain.catalog import DatasetSpec
from edgetrain.cli import main
from edgetrain.data import InMemoryImages, dataset_classes, load_dataset
from edgetrain.dataset_import import CIFAR10_DIR, import_image_folder
from edgetrain.datastore import IMAGE_BYTES, MANIFEST_FILE, DatasetImportError, read_manifest

pytestmark = pytest.mark.timeout(60)

BLOCK = 7
"""Samples per block in these tests: small, so that every split has several blocks."""
RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)
NOBODY = 65534
ERROR = "edgetrain data import: error: "


# --- writing real image files ---------------------------------------------------------------------

def _solid(path: Path, size: tuple[int, int], colour, mode: str = "RGB") -> Path:
    """A one-colour image file of `size` (width, height); its format follows the file's ending."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, colour).save(path)
    return path


def _noise(path: Path, size: tuple[int, int], seed: int, mode: str = "RGB") -> Path:
    """A random-pixel image file of `size` (width, height) in `mode` (RGB, L or RGBA)."""
    channels = {"RGB": 3, "L": 1, "RGBA": 4}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels[:, :, 0] if mode == "L" else pixels, mode).save(path)
    return path


def _jpeg_bytes(size: tuple[int, int], seed: int) -> bytes:
    buffer = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _image_folder(root: Path) -> dict[str, list[Path]]:
    """Three classes, created out of order: "apple" only solid-red PNGs, "bird" RGB/RGBA PNG and
    JPEG of several sizes (one in a nested sub-folder, one with an upper-case ending), "cat" only
    grayscale images (PNG and JPEG). notes.txt files lie beside them. {class: its image files}."""
    cat = [_solid(root / "cat" / "gray_50x40.png", (50, 40), 90, "L"),
           _noise(root / "cat" / "gray_96.jpg", (96, 96), 1, "L")]
    apple = [_solid(root / "apple" / f"red_{w}x{h}.png", (w, h), RED)
             for w, h in ((50, 40), (20, 20), (32, 32), (96, 96), (40, 50))]
    bird = [_noise(root / "bird" / "a_96.jpg", (96, 96), 2),
            _noise(root / "bird" / "b_32.JPG", (32, 32), 3),
            _noise(root / "bird" / "c_20.png", (20, 20), 4),
            _noise(root / "bird" / "d_rgba_32.png", (32, 32), 5, "RGBA"),
            _noise(root / "bird" / "e_50x40.jpeg", (50, 40), 6),
            _noise(root / "bird" / "more" / "deeper" / "f_40x50.jpg", (40, 50), 7)]
    (root / "notes.txt").write_text("taken in the lab, spring\n")
    (root / "bird" / "notes.txt").write_text("the blurry ones are birds too\n")
    (root / "bird" / "more" / "README").write_text("not an image\n")
    return {"apple": apple, "bird": bird, "cat": cat}


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _import_folder(source: Path, data_dir: Path, name: str, capsys, *extra) -> tuple[int, str, str]:
    return _run(["data", "import", "imagefolder", source, "--name", name, "--data-dir", data_dir,
                 "--block-samples", BLOCK, *extra], capsys)


def _one_error_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith(ERROR) and "Traceback" not in err, err
    return err


def _entries(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()} if directory.exists() else set()


def _store_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _pixels(dataset: InMemoryImages, label: int) -> torch.Tensor:
    return dataset.images[dataset.labels == label]


def _is_colour(images: torch.Tensor, colour) -> bool:
    return bool(torch.equal(images, torch.tensor(colour, dtype=torch.uint8).view(1, 3, 1, 1).expand_as(images)))


# --- an image folder ------------------------------------------------------------------------------

def test_an_image_folder_is_decoded_once_into_a_checked_store(tmp_path, capsys):
    # Prepare
    files = _image_folder(tmp_path / "lab")
    data_dir = tmp_path / "data"

    # Execute
    code, out, err = _import_folder(tmp_path / "lab", data_dir, "lab-set", capsys, "--test-fraction", 0.25)

    # Assert: 13 images; held out per class: apple 1 of 5, bird 2 of 6, cat 1 of 2 (never none)
    assert code == 0, err
    assert "'lab-set' imported into" in out and "9 train + 4 test images of 3 classes" in out
    assert "3 blocks of up to 7 samples" in out
    assert "held out: 0.25 of each class" in err and "Traceback" not in err
    store = data_dir / "lab-set"
    assert _entries(data_dir) == {"lab-set"}  # no staging directory is left
    assert _entries(store) == {MANIFEST_FILE, "train.images", "train.labels", "test.images", "test.labels"}
    manifest = read_manifest(store)
    assert manifest.dataset == "lab-set" and manifest.block_samples == BLOCK
    assert manifest.classes == ("apple", "bird", "cat")
    assert {split: s.samples for split, s in manifest.splits.items()} == {"train": 9, "test": 4}
    assert manifest.extra["kind"] == "imagefolder" and manifest.extra["skipped"] == []
    assert manifest.extra["source"] == str((tmp_path / "lab").resolve())
    for split, entry in manifest.splits.items():  # each block's sha256, computed from the files
        images = (store / f"{split}.images").read_bytes()
        labels = (store / f"{split}.labels").read_bytes()
        assert len(images) == entry.samples * IMAGE_BYTES and len(labels) == entry.samples
        expected = [hashlib.sha256(images[i * IMAGE_BYTES:(i + BLOCK) * IMAGE_BYTES] + labels[i:i + BLOCK]).hexdigest()
                    for i in range(0, entry.samples, BLOCK)]
        assert list(entry.blocks) == expected
    assert len(manifest.splits["train"].blocks) == 2 and len(manifest.splits["test"].blocks) == 1

    spec = DatasetSpec(name="lab-set", data_dir=str(data_dir))
    train, test = load_dataset(spec, train=True), load_dataset(spec, train=False)
    for split in (train, test):
        assert isinstance(split, InMemoryImages) and split.classes == ("apple", "bird", "cat")
        assert split.images.dtype == torch.uint8 and split.images.shape[1:] == (3, 32, 32)
    assert train.images.shape[0] == 9 and test.images.shape[0] == 4
    for label, name in enumerate(("apple", "bird", "cat")):
        in_train, in_test = int((train.labels == label).sum()), int((test.labels == label).sum())
        assert in_train + in_test == len(files[name]) and in_train >= 1 and in_test >= 1, name
    # every red image, whatever its size, is pure red at 32x32, and only the apples are red
    assert _is_colour(_pixels(train, 0), RED) and _is_colour(_pixels(test, 0), RED)
    for split in (train, test):
        for label in (1, 2):
            assert not any(_is_colour(image[None], RED) for image in _pixels(split, label))
    # grayscale files come back as RGB with three equal channels; the solid one keeps its value
    gray = torch.cat([_pixels(train, 2), _pixels(test, 2)])
    assert torch.equal(gray[:, 0], gray[:, 1]) and torch.equal(gray[:, 1], gray[:, 2])
    assert sum(_is_colour(image[None], (90, 90, 90)) for image in gray) == 1
    # the RGB and RGBA bird images are not gray
    birds = torch.cat([_pixels(train, 1), _pixels(test, 1)])
    assert all(not torch.equal(image[0], image[1]) for image in birds)


def test_a_training_cut_reads_the_first_samples_and_classes_need_no_images(tmp_path, capsys):
    # Prepare
    _image_folder(tmp_path / "lab")
    data_dir = tmp_path / "data"
    assert _import_folder(tmp_path / "lab", data_dir, "lab", capsys, "--test-fraction", 0.25)[0] == 0
    whole = load_dataset(DatasetSpec(name="lab", data_dir=str(data_dir)), train=True)

    # Execute
    cut = load_dataset(DatasetSpec(name="lab", data_dir=str(data_dir), train_size=5), train=True)
    with pytest.raises(ValueError, match=r"requested 10 samples but the 'lab' train split has 9"):
        load_dataset(DatasetSpec(name="lab", data_dir=str(data_dir), train_size=10), train=True)
    for split in ("train", "test"):
        (data_dir / "lab" / f"{split}.images").unlink()
    classes = dataset_classes(DatasetSpec(name="lab", data_dir=str(data_dir)))

    # Assert
    assert len(cut) == 5 and torch.equal(cut.images, whole.images[:5]) and torch.equal(cut.labels, whole.labels[:5])
    assert cut.classes == ("apple", "bird", "cat")
    assert classes == ("apple", "bird", "cat")  # from the manifest alone: the images are gone
    with pytest.raises(FileNotFoundError, match="train.images: missing"):
        load_dataset(DatasetSpec(name="lab", data_dir=str(data_dir)), train=True)
    with pytest.raises(FileNotFoundError, match="'other' is not imported"):
        dataset_classes(DatasetSpec(name="other", data_dir=str(data_dir)))


def test_train_and_test_folders_give_the_splits_and_valid_is_ignored(tmp_path, capsys):
    # Prepare: the test split has only two of the three training classes
    root = tmp_path / "cinic"
    for i, (w, h) in enumerate(((32, 32), (50, 40), (20, 20))):
        _solid(root / "train" / "a" / f"red{i}.png", (w, h), RED)
    for i, (w, h) in enumerate(((96, 96), (32, 32))):
        _solid(root / "train" / "b" / f"blue{i}.png", (w, h), BLUE)
    for i, (w, h) in enumerate(((96, 96), (50, 40))):
        (root / "train" / "c").mkdir(parents=True, exist_ok=True)
        (root / "train" / "c" / f"noise{i}.jpg").write_bytes(_jpeg_bytes((w, h), i))
    for i in range(2):
        _solid(root / "test" / "b" / f"blue{i}.png", (40, 40), BLUE)
    _solid(root / "test" / "c" / "green.png", (32, 32), GREEN)
    for name in ("a", "b", "c", "zz"):  # read, this would add a class or fail on the bad file
        _solid(root / "valid" / name / "x.png", (32, 32), RED)
    (root / "valid" / "zz" / "broken.png").write_text("not a png")
    data_dir = tmp_path / "data"

    # Execute
    code, out, err = _import_folder(root, data_dir, "cinic", capsys, "--test-fraction", 0.5)

    # Assert
    assert code == 0, err
    manifest = read_manifest(data_dir / "cinic")
    assert manifest.classes == ("a", "b", "c")
    assert {split: s.samples for split, s in manifest.splits.items()} == {"train": 7, "test": 3}
    assert manifest.extra["layout"] == "train/ and test/"
    spec = DatasetSpec(name="cinic", data_dir=str(data_dir))
    train, test = load_dataset(spec, train=True), load_dataset(spec, train=False)
    assert sorted(train.labels.tolist()) == [0, 0, 0, 1, 1, 2, 2]
    assert _is_colour(_pixels(train, 0), RED) and _is_colour(_pixels(train, 1), BLUE)
    # test/'s classes are numbered as train/'s: b is 1 and c is 2, though test/ has no a
    assert sorted(test.labels.tolist()) == [1, 1, 2]
    assert _is_colour(_pixels(test, 1), BLUE) and _is_colour(_pixels(test, 2), GREEN)


def test_a_test_class_without_a_training_folder_is_refused(tmp_path, capsys):
    # Prepare
    root = tmp_path / "cinic"
    for name in ("a", "b"):
        _solid(root / "train" / name / "x.png", (32, 32), RED)
        _solid(root / "test" / name / "y.png", (32, 32), RED)
    _solid(root / "test" / "zebra" / "z.png", (32, 32), BLUE)
    data_dir = tmp_path / "data"

    # Execute
    code, out, err = _import_folder(root, data_dir, "cinic", capsys)

    # Assert
    assert code == 2
    _one_error_line(err)
    assert str(root / "test" / "zebra") in err and "test class 'zebra' has no training folder" in err
    assert _entries(data_dir) == set()


# --- refusals -------------------------------------------------------------------------------------

def _bad_folders(tmp_path: Path) -> list[tuple[str, Path, str, str]]:
    """(case, source, --name, what the one error line says) for each refused import."""
    good = tmp_path / "good"
    _image_folder(good)
    one_class = tmp_path / "one-class"
    _solid(one_class / "only" / "x.png", (32, 32), RED)
    flat = tmp_path / "flat"
    _solid(flat / "x.png", (32, 32), RED)
    _noise(flat / "y.jpg", (50, 40), 1)
    (flat / "notes.txt").write_text("no classes here\n")
    empty_class = tmp_path / "empty-class"
    _solid(empty_class / "a" / "x.png", (32, 32), RED)
    (empty_class / "b" / "sub").mkdir(parents=True)
    (empty_class / "b" / "notes.txt").write_text("images to come\n")
    a_file = tmp_path / "a-file.png"
    _solid(a_file, (32, 32), RED)
    return [
        ("one class", one_class, "set", f"{one_class}: one class folder ('only'); an image folder needs at least 2"),
        ("images directly", flat, "set",
         f"{flat}: 0 class folders; an image folder needs at least 2 (one sub-folder per class) (2 images lie in it "
         "directly: put each class's images in a sub-folder named for it)"),
        ("class without images", empty_class, "set", f"{empty_class / 'b'}: class folder without images"),
        ("no such path", tmp_path / "absent", "set", f"{tmp_path / 'absent'}: no such directory"),
        ("a file", a_file, "set", f"{a_file}: not a directory"),
        ("spaced name", good, "My Set", "bad dataset name 'My Set'"),
        ("path name", good, "../x", "bad dataset name '../x'"),
        ("empty name", good, "", "give the path and --name"),
        ("cifar10", good, "cifar10", "dataset name 'cifar10' is taken by a built-in dataset"),
        ("synthetic", good, "synthetic", "dataset name 'synthetic' is taken by a built-in dataset"),
    ]


def test_bad_folders_and_names_are_one_line_each_and_write_nothing(tmp_path, capsys):
    # Prepare: the data directory already holds something of its own
    data_dir = tmp_path / "data"
    (data_dir / "kept").mkdir(parents=True)
    (data_dir / "kept" / "file").write_text("mine")
    cases = _bad_folders(tmp_path)

    for case, source, name, expected in cases:
        # Execute
        code, out, err = _import_folder(source, data_dir, name, capsys)

        # Assert
        assert code == 2, case
        _one_error_line(err)
        assert expected in err, (case, err)
        assert out == "", case
        assert _entries(data_dir) == {"kept"}, case  # no store, no staging directory
        assert (data_dir / "kept" / "file").read_text() == "mine"
    assert not (tmp_path / "x").exists()  # "../x" wrote nothing beside the data directory either


def _folder_with_bad_files(root: Path) -> tuple[list[Path], int]:
    """The lab folder plus a truncated JPEG (in apple) and a text file named .png (in a nested
    folder of bird): (the bad files, the number of good images)."""
    files = _image_folder(root)
    whole = _jpeg_bytes((96, 96), 11)
    truncated = root / "apple" / "truncated.jpg"
    truncated.write_bytes(whole[: len(whole) // 2])
    fake = root / "bird" / "more" / "fake.png"
    fake.write_text("this is a text file, not a PNG\n" * 20)
    return [truncated, fake], sum(len(paths) for paths in files.values())


def test_unreadable_images_are_each_named_and_nothing_is_written(tmp_path, capsys):
    # Prepare
    (bad_files, good) = _folder_with_bad_files(tmp_path / "lab")
    data_dir = tmp_path / "data"
    data_dir.mkdir()

    # Execute
    code, out, err = _import_folder(tmp_path / "lab", data_dir, "lab", capsys)

    # Assert: one line per bad file, then the summary
    assert code == 2 and out == "" and "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 3 and err.endswith("\n"), err
    assert lines[0].startswith(f"{ERROR}{bad_files[0]}: cannot decode it (OSError: "), lines[0]
    assert lines[1] == f"{ERROR}{bad_files[1]}: not an image Pillow can read"
    assert lines[2].startswith(f"{ERROR}2 of {good + 2} image files could not be decoded (each named above)")
    assert lines[2].endswith("or import the rest with --skip-bad; nothing was written")
    assert _entries(data_dir) == set()


def test_skip_bad_imports_the_rest_and_records_what_it_left_out(tmp_path, capsys):
    # Prepare
    bad_files, good = _folder_with_bad_files(tmp_path / "lab")
    data_dir = tmp_path / "data"

    # Execute
    code, out, err = _import_folder(tmp_path / "lab", data_dir, "lab", capsys, "--skip-bad")

    # Assert
    assert code == 0, err
    for path in bad_files:
        assert f"note: skipped {path}: " in err
    manifest = read_manifest(data_dir / "lab")
    skipped = manifest.extra["skipped"]
    assert len(skipped) == 2 and all(any(s.startswith(f"{p}: ") for s in skipped) for p in bad_files)
    assert sum(s.samples for s in manifest.splits.values()) == good
    spec = DatasetSpec(name="lab", data_dir=str(data_dir))
    assert len(load_dataset(spec, train=True)) + len(load_dataset(spec, train=False)) == good
    assert _entries(data_dir) == {"lab"}


def _huge_png(path: Path, side: int = 20_000) -> Path:
    """A PNG file whose header claims `side` x `side` pixels (400 million: more than Pillow opens,
    a "decompression bomb"), 69 bytes on disk."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))
    return path


def test_an_image_too_large_for_pillow_is_named_like_any_unreadable_image(tmp_path, capsys):
    # Prepare
    files = _image_folder(tmp_path / "lab")
    huge = _huge_png(tmp_path / "lab" / "bird" / "panorama.png")
    data_dir = tmp_path / "data"

    # Execute
    refused = _import_folder(tmp_path / "lab", data_dir, "lab", capsys)
    skipped = _import_folder(tmp_path / "lab", data_dir, "lab", capsys, "--skip-bad")

    # Assert
    assert refused[0] == 2 and f"{ERROR}{huge}: " in refused[2] and "Traceback" not in refused[2]
    assert skipped[0] == 0 and f"note: skipped {huge}: " in skipped[2]
    assert sum(s.samples for s in read_manifest(data_dir / "lab").splits.values()) == sum(map(len, files.values()))


def test_a_data_dir_that_is_a_file_is_one_error_line(tmp_path, capsys):
    # Prepare
    _image_folder(tmp_path / "lab")
    not_a_dir = tmp_path / "data"
    not_a_dir.write_text("a file where the data directory should be")

    for data_dir in (not_a_dir, not_a_dir / "sub"):
        # Execute
        code, out, err = _import_folder(tmp_path / "lab", data_dir, "lab", capsys)

        # Assert
        assert code != 0 and err.count("\n") == 1 and "Traceback" not in err, err
        assert str(not_a_dir) in err
        assert not_a_dir.read_text() == "a file where the data directory should be"


def _report_import_error(conn, source: str, data_dir: str, as_nobody: bool) -> None:
    """In a child process: try the import (as nobody when asked) and send back what it raised."""
    try:
        if as_nobody:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        import_image_folder(Path(source), data_dir, "locked")
        conn.send("imported")
    except DatasetImportError as e:
        conn.send(f"DatasetImportError: {e}")
    except BaseException as e:  # noqa: BLE001 - anything else is what the test reports
        conn.send(f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def test_a_class_folder_that_cannot_be_read_is_named(tmp_path):
    # Prepare: a folder everyone may traverse, with one class folder no one may read
    top = Path(tempfile.mkdtemp(prefix="edgetrain-locked-", dir="/tmp"))
    os.chmod(top, 0o755)
    locked = top / "lab" / "b"
    try:
        for name in ("a", "b"):
            for i in range(2):
                _solid(top / "lab" / name / f"{i}.png", (32, 32), RED)
        for path in (top / "lab", top / "lab" / "a"):
            os.chmod(path, 0o755)
        os.chmod(locked, 0)
        as_nobody = os.geteuid() == 0
        if not as_nobody and os.access(locked, os.R_OK):
            pytest.skip("chmod 000 does not stop this user from reading a directory")

        # Execute
        context = multiprocessing.get_context("fork")
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_report_import_error,
                                args=(send, str(top / "lab"), str(top / "data"), as_nobody))
        child.start()
        send.close()
        assert receive.poll(30), "the child process sent nothing"
        message = receive.recv()
        child.join(30)

        # Assert
        assert child.exitcode == 0
        assert message == f"DatasetImportError: {locked}: cannot read it (permission denied)"
        assert not (top / "data").exists()
    finally:
        os.chmod(locked, 0o755)
        shutil.rmtree(top)


def test_a_failed_reimport_keeps_the_old_store_and_a_good_one_replaces_it(tmp_path, capsys):
    # Prepare
    _image_folder(tmp_path / "lab")
    data_dir = tmp_path / "data"
    assert _import_folder(tmp_path / "lab", data_dir, "pets", capsys)[0] == 0
    before = _store_files(data_dir / "pets")
    _folder_with_bad_files(tmp_path / "broken")
    other = tmp_path / "other"
    for name, colour in (("dogs", BLUE), ("eels", GREEN)):
        for i in range(3):
            _solid(other / name / f"{i}.png", (20 + 10 * i, 32), colour)

    # Execute
    failed = _import_folder(tmp_path / "broken", data_dir, "pets", capsys)
    unchanged = _store_files(data_dir / "pets")
    replaced = _import_folder(other, data_dir, "pets", capsys)

    # Assert
    assert failed[0] == 2
    assert unchanged == before  # manifest and blocks, byte for byte
    assert replaced[0] == 0, replaced[2]
    manifest = read_manifest(data_dir / "pets")
    assert manifest.classes == ("dogs", "eels")
    assert {split: s.samples for split, s in manifest.splits.items()} == {"train": 4, "test": 2}
    assert _entries(data_dir) == {"pets"}  # the old store is gone, no staging directory is left
    assert set(_store_files(data_dir / "pets")) == set(before)


# --- sets in CIFAR-10's python layout -------------------------------------------------------------

NAMES = ["ant", "bee", "cow", "dog"]


def _batch(images: np.ndarray, labels, name: str) -> bytes:
    entry = {"batch_label": name, "labels": [int(x) for x in labels], "data": images,
             "filenames": [f"{name}_{i}.png" for i in range(len(labels))]}
    return pickle.dumps(entry, protocol=2)


def _cifar_set(seed: int = 3, *, train_batches=(30, 20, 25), test: int = 15,
               names=NAMES) -> tuple[dict[str, bytes], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """({file name: bytes}, {split: (uint8 (N, 3072) images, uint8 labels)}) of a small set in
    CIFAR-10's python layout with its own class names."""
    rng = np.random.default_rng(seed)
    files, parts = {}, {"train": [], "test": []}
    batches = [(f"data_batch_{i + 1}", n) for i, n in enumerate(train_batches)] + [("test_batch", test)]
    for name, count in batches:
        images = rng.integers(0, 256, (count, IMAGE_BYTES), dtype=np.uint8)
        labels = rng.integers(0, len(names), count)
        files[name] = _batch(images, labels, name)
        parts["test" if name == "test_batch" else "train"].append((images, labels))
    files["batches.meta"] = pickle.dumps({"label_names": list(names), "num_cases_per_batch": 30,
                                          "num_vis": IMAGE_BYTES}, protocol=2)
    arrays = {split: (np.concatenate([p[0] for p in ps]), np.concatenate([p[1] for p in ps]).astype(np.uint8))
              for split, ps in parts.items()}
    return files, arrays


def _archive(path: Path, files: dict[str, bytes], top: str = "my-set-py") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name in sorted(files, reverse=True):  # data_batch_3 before data_batch_1: order is by name
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(files[name])
            tar.addfile(info, io.BytesIO(files[name]))
    return path


def _directory(path: Path, files: dict[str, bytes]) -> Path:
    path.mkdir(parents=True)
    for name, payload in files.items():
        (path / name).write_bytes(payload)
    return path


def _import_cifar(source: Path, data_dir: Path, name: str, capsys) -> tuple[int, str, str]:
    return _run(["data", "import", "cifar", source, "--name", name, "--data-dir", data_dir,
                 "--block-samples", 16], capsys)


def test_a_cifar_format_archive_of_its_own_classes_is_stored_in_order(tmp_path, capsys):
    # Prepare
    files, arrays = _cifar_set()
    archive = _archive(tmp_path / "my-set.tar.gz", files)
    data_dir = tmp_path / "data"

    # Execute
    code, out, err = _import_cifar(archive, data_dir, "myset", capsys)

    # Assert
    assert code == 0, err
    assert "'myset' imported into" in out and "75 train + 15 test images of 4 classes" in out
    assert "3 training batch files (data_batch_1, data_batch_2, data_batch_3)" in err
    manifest = read_manifest(data_dir / "myset")
    assert manifest.classes == tuple(NAMES) and manifest.extra["kind"] == "cifar"
    assert {split: (s.samples, len(s.blocks)) for split, s in manifest.splits.items()} == {
        "train": (75, 5), "test": (15, 1)}
    for split, (images, labels) in arrays.items():
        stored = np.fromfile(data_dir / "myset" / f"{split}.images", dtype=np.uint8).reshape(-1, IMAGE_BYTES)
        assert np.array_equal(stored, images)
        assert np.array_equal(np.fromfile(data_dir / "myset" / f"{split}.labels", dtype=np.uint8), labels)
        loaded = load_dataset(DatasetSpec(name="myset", data_dir=str(data_dir)), train=split == "train")
        assert loaded.classes == tuple(NAMES)
        assert torch.equal(loaded.images, torch.from_numpy(images.reshape(-1, 3, 32, 32)))
        assert loaded.labels.tolist() == labels.tolist()
    assert _entries(data_dir) == {"myset"}  # the archive's read-out directory is gone


def test_the_extracted_cifar_format_directory_imports_too(tmp_path, capsys):
    # Prepare
    files, arrays = _cifar_set(seed=5)
    with tarfile.open(_archive(tmp_path / "my-set.tar.gz", files)) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    data_dir = tmp_path / "data"

    # Execute
    code, out, err = _import_cifar(tmp_path / "unpacked" / "my-set-py", data_dir, "myset", capsys)

    # Assert
    assert code == 0, err
    spec = DatasetSpec(name="myset", data_dir=str(data_dir))
    assert dataset_classes(spec) == tuple(NAMES)
    train = load_dataset(spec, train=True)
    assert torch.equal(train.images, torch.from_numpy(arrays["train"][0].reshape(-1, 3, 32, 32)))
    assert train.labels.tolist() == arrays["train"][1].tolist()


def test_bad_cifar_format_sets_are_one_line_and_write_nothing(tmp_path, capsys):
    # Prepare
    files, _ = _cifar_set()
    rng = np.random.default_rng(9)
    out_of_range = dict(files, data_batch_2=_batch(rng.integers(0, 256, (5, IMAGE_BYTES), dtype=np.uint8),
                                                   [0, 1, 2, 3, 4], "data_batch_2"))
    bad_label_dir = _directory(tmp_path / "bad-label", out_of_range)
    bad_label_archive = _archive(tmp_path / "bad-label.tar.gz", out_of_range)
    no_meta = _archive(tmp_path / "no-meta.tar.gz", {k: v for k, v in files.items() if k != "batches.meta"})
    data_dir = tmp_path / "data"
    cases = [
        (bad_label_dir, f"{bad_label_dir / 'data_batch_2'}: labels must be in 0..3 (its batches.meta names 4 "
                        "classes), found 0..4"),
        (bad_label_archive, f"{bad_label_archive}: data_batch_2: labels must be in 0..3"),  # the archive, not a temp dir
        (no_meta, f"{no_meta}: not a CIFAR python archive (no batches.meta)"),
    ]

    for source, expected in cases:
        # Execute
        code, out, err = _import_cifar(source, data_dir, "myset", capsys)

        # Assert
        assert code == 2, source
        _one_error_line(err)
        assert expected in err, err
        assert _entries(data_dir) == set(), source


def test_cifar10_refuses_a_set_that_is_not_ten_classes_and_names_the_right_command(tmp_path, capsys):
    # Prepare: the file names of CIFAR-10, in its directory name, but four classes of its own
    files, _ = _cifar_set(train_batches=(10, 10, 10, 10, 10), test=10)
    source = _directory(tmp_path / "src" / CIFAR10_DIR, files)
    data_dir = tmp_path / "data"

    # Execute
    code, out, err = _run(["data", "import", "cifar10", source, "--data-dir", data_dir], capsys)

    # Assert
    assert code == 2
    _one_error_line(err)
    assert "names 4 classes, CIFAR-10 has 10" in err
    assert "import a set of your own with `edgetrain data import cifar PATH --name NAME`" in err
    assert _entries(data_dir) == set()


# --- listing --------------------------------------------------------------------------------------

def test_list_names_each_imported_dataset_with_its_sizes_and_classes(tmp_path, capsys):
    # Prepare
    data_dir = tmp_path / "data"
    empty = _run(["data", "list", "--data-dir", data_dir], capsys)
    _image_folder(tmp_path / "lab")
    assert _import_folder(tmp_path / "lab", data_dir, "lab", capsys, "--test-fraction", 0.25)[0] == 0
    files, _ = _cifar_set()
    assert _import_cifar(_archive(tmp_path / "set.tar.gz", files), data_dir, "myset", capsys)[0] == 0
    (data_dir / "not-a-dataset").mkdir()

    # Execute
    code, out, err = _run(["data", "list", "--data-dir", data_dir], capsys)

    # Assert
    assert empty[0] == 0 and empty[1] == f"no dataset imported under {data_dir}\n"
    assert code == 0 and err == ""
    assert out.splitlines() == ["lab: 9 train, 4 test; 3 classes (apple, bird, cat)",
                                "myset: 75 train, 15 test; 4 classes (ant, bee, cow, dog)"]



def test_a_16_bit_grey_image_keeps_its_tones(tmp_path, capsys):
    # Prepare: a 16-bit grey ramp (Pillow's own conversion to RGB would clip it to near-white)
    root = tmp_path / "grey"
    for name in ("dark", "light"):
        (root / name).mkdir(parents=True)
    ramp = np.tile(np.linspace(0, 65535, 32, dtype=np.uint16), (32, 1))
    Image.fromarray(ramp).save(root / "dark" / "ramp.png")
    Image.fromarray(np.full((32, 32), 60000, np.uint16)).save(root / "light" / "flat.png")
    Image.fromarray(np.full((32, 32), 60000, np.uint16)).save(root / "light" / "flat2.png")

    # Execute
    code, _, _ = _import_folder(root, tmp_path / "data", "grey", capsys, "--test-fraction", "0.5")

    # Assert: the ramp runs from black to white, as its 16 bits said
    assert code == 0
    dataset = load_dataset(DatasetSpec(name="grey", data_dir=str(tmp_path / "data")), train=True)
    dark = dataset.images[dataset.labels == 0]
    assert len(dark) == 1 and int(dark[0, 0, 5, 0]) < 10 and int(dark[0, 0, 5, -1]) > 245
