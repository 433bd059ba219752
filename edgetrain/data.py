"""The datasets a job trains on — two tiers of synthetic CIFAR-shaped data, CIFAR-10 and the
datasets imported on the gateway (edgetrain.datastore) — plus deterministic batch assembly.

Every process that builds the batch for the same ``(indices, step)`` gets identical tensors:
synthetic items are a pure function of ``(seed, split, index)`` computed in integer arithmetic,
and a sample's augmentation is a pure function of ``(seed, step, index)``. That is what lets the
coordinator split a global batch across devices while single-process reference training sees
the same samples.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from edgetrain.catalog import DatasetSpec, dataset_is_synthetic
from edgetrain.dataset_import import CIFAR10, dataset_dir, import_command, read_imported_split
from edgetrain.datastore import CIFAR10_CLASSES, DatasetImportError, read_manifest

logger = logging.getLogger(__name__)

CIFAR10_MEAN: tuple[float, float, float] = (0.4914, 0.4822, 0.4465)
"""Per-channel mean of the CIFAR-10 training images (pixels scaled to [0, 1])."""
CIFAR10_STD: tuple[float, float, float] = (0.2470, 0.2435, 0.2616)
"""Per-channel standard deviation of the CIFAR-10 training images (pixels scaled to [0, 1])."""

NUM_CLASSES = 10
"""Classes of the generated datasets (and of CIFAR-10)."""
SYNTHETIC_CLASSES: tuple[str, ...] = tuple(f"class{i}" for i in range(NUM_CLASSES))
"""The generated datasets' class names."""
IMAGE_SIZE = 32
CROP_PADDING = 4

_MASK64 = (1 << 64) - 1
# Stream tags keep the hashes used for different purposes independent of each other.
_TEMPLATE_STREAM, _ITEM_STREAM, _NOISE_STREAM, _LABEL_STREAM, _AUGMENT_STREAM = range(5)
# The hard tier's own streams (the first five keep the ``synthetic`` tier's data unchanged).
_PART_STREAM, _CLUTTER_STREAM, _LOOK_STREAM, _FLIP_LABEL_STREAM = range(5, 9)

# Synthetic image recipe, in 8-bit pixel units: a smooth class template (coarse random grid,
# bilinearly upsampled) scaled by a random contrast, shifted, brightened, plus pixel noise.
_TEMPLATE_GRID = 4
_TEMPLATE_AMPLITUDE = 64
_MAX_SHIFT = 3
_CONTRAST_SIXTEENTHS = (8, 24)
_MAX_BRIGHTNESS = 24
_NOISE_TERMS = 3
_NOISE_HALF_WIDTH = 64


def _mix(*values: int) -> int:
    """A 64-bit hash of a sequence of integers (SplitMix64 steps), identical on every machine."""
    state = 0
    for value in values:
        state = ((state ^ (value & _MASK64)) + 0x9E3779B97F4A7C15) & _MASK64
        state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & _MASK64
        state ^= state >> 31
    return state


def _generator(*values: int) -> torch.Generator:
    """A CPU generator seeded from a hash of ``values`` (63 bits, a valid torch seed)."""
    return torch.Generator().manual_seed(_mix(*values) >> 1)


_MEAN = torch.tensor(CIFAR10_MEAN).view(3, 1, 1)
_STD = torch.tensor(CIFAR10_STD).view(3, 1, 1)


def normalize(pixels: torch.Tensor) -> torch.Tensor:
    """Turn uint8 pixels (..., 3, H, W) into float32 normalised with the CIFAR-10 statistics."""
    return (pixels.to(torch.float32) / 255.0 - _MEAN) / _STD


def _smooth(x: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    """Circular box filter of ``width`` along ``dim``, in exact integer arithmetic."""
    return sum(torch.roll(x, shifts=k, dims=dim) for k in range(width)) // width


def _smooth_patterns(count: int, grid: int, amplitude: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` smooth random int32 patterns (3, 32, 32) with values in [-amplitude, amplitude].

    A coarse random ``grid`` x ``grid`` upsampled by repetition then box-filtered over one cell
    equals bilinear interpolation; doing it on integers keeps patterns bit-identical across
    machines.
    """
    cell = IMAGE_SIZE // grid
    coarse = torch.randint(
        -amplitude, amplitude + 1, (count, 3, grid, grid), generator=generator, dtype=torch.int32
    )
    fine = coarse.repeat_interleave(cell, dim=2).repeat_interleave(cell, dim=3)
    return _smooth(_smooth(fine, dim=2, width=cell), dim=3, width=cell)


def _class_templates(seed: int) -> torch.Tensor:
    """One smooth random int32 pattern (3, 32, 32) per class, a pure function of ``seed``."""
    return _smooth_patterns(
        NUM_CLASSES, _TEMPLATE_GRID, _TEMPLATE_AMPLITUDE, _generator(_TEMPLATE_STREAM, seed)
    )


class _GeneratedImages(Dataset):
    """What both synthetic tiers share: ``size`` items of one split, each a pure function of
    ``(seed, split, index)``, every class once in each aligned block of 10 indices. A tier
    supplies ``pixels(index)`` and ``label(index)``."""

    classes: tuple[str, ...] = SYNTHETIC_CLASSES

    def __init__(self, *, train: bool, size: int, seed: int) -> None:
        if size <= 0:
            raise ValueError(f"size must be > 0, got {size}")
        self.train = train
        self.size = size
        self.seed = seed
        self._split = 0 if train else 1

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        index = int(index)
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} items")
        return normalize(self.pixels(index)), self.label(index)

    def _block_class(self, index: int) -> int:
        """The class of item ``index``: each aligned block of 10 indices holds every class once."""
        block, position = divmod(index, NUM_CLASSES)
        return (position + _mix(_LABEL_STREAM, self.seed, self._split, block)) % NUM_CLASSES


class SyntheticCIFAR10(_GeneratedImages):
    """SYNTHETIC CIFAR-shaped data, not real CIFAR-10: 10 classes of generated 32x32 images.

    Each class has a smooth random colour pattern; an item is its class pattern with a random
    contrast, a circular shift of up to 3 pixels, a random brightness and strong pixel noise.
    Learnable but not instantly: ``small_cnn`` reaches roughly 60-90% test accuracy after 150
    SGD steps of batch 32, MobileNetV2 over 90% after about 75 steps of batch 64.
    Item ``i`` is a pure function of ``(seed, train/test, i)``, computed with integer arithmetic
    and per-item generators, so it is identical in every process and on every machine; train
    and test share the class patterns but not the items. Labels are exactly balanced in every
    aligned run of 10 indices. Items are ``(float32 (3, 32, 32) normalised image, int label)``.
    """

    def __init__(self, *, train: bool, size: int, seed: int) -> None:
        super().__init__(train=train, size=size, seed=seed)
        self._templates = _class_templates(seed)

    def label(self, index: int) -> int:
        """Label of item ``index``: each aligned block of 10 indices holds every class once."""
        return self._block_class(index)

    def pixels(self, index: int) -> torch.Tensor:
        """The uint8 (3, 32, 32) image of item ``index``, before normalisation."""
        draw = _mix(_ITEM_STREAM, self.seed, self._split, index)
        span = 2 * _MAX_SHIFT + 1
        shifts = (draw % span - _MAX_SHIFT, (draw >> 8) % span - _MAX_SHIFT)
        low, high = _CONTRAST_SIXTEENTHS
        contrast = low + (draw >> 16) % (high - low + 1)
        brightness = (draw >> 24) % (2 * _MAX_BRIGHTNESS + 1) - _MAX_BRIGHTNESS
        noise = torch.randint(
            -_NOISE_HALF_WIDTH,
            _NOISE_HALF_WIDTH + 1,
            (_NOISE_TERMS, 3, IMAGE_SIZE, IMAGE_SIZE),
            generator=_generator(_NOISE_STREAM, self.seed, self._split, index),
            dtype=torch.int32,
        ).sum(dim=0)
        pattern = torch.roll(self._templates[self.label(index)], shifts=shifts, dims=(1, 2))
        pixels = 128 + brightness + contrast * pattern // 16 + noise
        return pixels.clamp_(0, 255).to(torch.uint8)


@dataclass(frozen=True, kw_only=True)
class HardRecipe:
    """How the ``synthetic-hard`` tier draws an image; every figure is an integer (8-bit pixel
    units, or sixteenths for factors). `HARD_RECIPE` is the calibrated one (docs/calibration.md);
    others exist only for calibration (scripts/calibrate_synthetic.py)."""

    parts: int = 3
    """Sub-patterns per class; an item mixes its class's primary sub-pattern with another."""
    part_grid: int = 4
    """Coarse grid of a sub-pattern (4: smooth blobs of 8 pixels)."""
    part_amplitude: int = 64
    """Largest absolute value of a sub-pattern."""
    shared_sixteenths: int = 0
    """Weight of a pattern all classes share in each sub-pattern (> 0: classes overlap)."""
    mix_sixteenths: int = 4
    """Largest weight of the secondary sub-pattern (the primary keeps the rest of 16)."""
    max_shift: int = 8
    """Largest circular shift of the object, in pixels, per axis."""
    scale_sixteenths: tuple[int, int] = (14, 18)
    """Range of the object's zoom factor per axis (16: none; nearest-pixel sampling)."""
    gain_sixteenths: tuple[int, int] = (8, 24)
    """Range of the per-channel contrast (colour jitter)."""
    max_offset: int = 24
    """Largest per-channel brightness offset (colour jitter)."""
    clutter_patterns: int = 32
    """Background patterns shared by all classes; an item adds one, shifted anywhere."""
    clutter_grid: int = 8
    """Coarse grid of a clutter pattern (8: finer texture than the objects)."""
    clutter_amplitude: int = 64
    """Largest absolute value of a clutter pattern."""
    clutter_sixteenths: tuple[int, int] = (0, 8)
    """Range of the clutter's weight."""
    noise_half_width: int = 32
    """Pixel noise: one uniform integer in [-w, w] per pixel and channel."""
    label_noise_percent: int = 4
    """Percent of training items labelled with another class, even (test labels are clean)."""

    def __post_init__(self) -> None:
        if self.parts < 2 or IMAGE_SIZE % self.part_grid or IMAGE_SIZE % self.clutter_grid:
            raise ValueError(f"bad hard recipe {self}: parts >= 2, grids must divide {IMAGE_SIZE}")
        if self.label_noise_percent not in range(0, 21, 2):
            raise ValueError(f"label_noise_percent must be even, 0 to 20, got {self.label_noise_percent}")


HARD_RECIPE = HardRecipe()
"""The calibrated recipe of ``synthetic-hard``."""


class SyntheticHardCIFAR10(_GeneratedImages):
    """SYNTHETIC CIFAR-shaped data made to tell training methods apart: 10 harder classes.

    What makes CIFAR-10 hard, in miniature: each class has several unrelated sub-patterns and an
    item mixes its primary sub-pattern with a little of a second one; the object is zoomed per
    axis and circularly shifted; each colour channel gets its own contrast and brightness, so
    colour alone does not tell classes apart; a background texture drawn from a pool all classes
    share is added, then pixel noise; and a few percent of training labels are wrong (test labels
    are clean). A nearest-class-mean classifier on pixels, near perfect on ``synthetic``, gets about a
    third right here.
    Calibrated so that MobileNetV2 needs several epochs of 5000 items to pass 70% test accuracy
    (5 epochs, centralized, batch 64; docs/calibration.md). Items are pure functions of ``(seed, train/test, index)`` computed in
    integer arithmetic, identical in every process. Labels, noisy or not, are exactly balanced in
    every aligned run of 10 indices: label noise swaps the labels of two items of a block.
    """

    def __init__(self, *, train: bool, size: int, seed: int, recipe: HardRecipe = HARD_RECIPE) -> None:
        super().__init__(train=train, size=size, seed=seed)
        self.recipe = recipe
        r = recipe
        shared = _smooth_patterns(1, r.part_grid, r.part_amplitude, _generator(_PART_STREAM, seed, -1))
        own = _smooth_patterns(
            NUM_CLASSES * r.parts, r.part_grid, r.part_amplitude, _generator(_PART_STREAM, seed)
        )
        mixed = (r.shared_sixteenths * shared + (16 - r.shared_sixteenths) * own) // 16
        self._parts = mixed.view(NUM_CLASSES, r.parts, 3, IMAGE_SIZE, IMAGE_SIZE)
        self._clutter = _smooth_patterns(
            r.clutter_patterns, r.clutter_grid, r.clutter_amplitude, _generator(_CLUTTER_STREAM, seed)
        )
        low, high = r.scale_sixteenths
        centred = torch.arange(IMAGE_SIZE) - IMAGE_SIZE // 2
        # Source row/column of each output pixel for each zoom, before the shift.
        self._zoom = {s: centred * 16 // s + IMAGE_SIZE // 2 for s in range(low, high + 1)}

    def clean_label(self, index: int) -> int:
        """The class item ``index`` was drawn from: every class once per aligned block of 10."""
        return self._block_class(index)

    def label(self, index: int) -> int:
        """The label item ``index`` carries: its class, except on the training split, where in
        every aligned run of 100 items label_noise_percent / 2 blocks of 10 (a cyclic run of
        blocks from a hashed start) swap the labels of two of their items, so exactly
        label_noise_percent % of the items are mislabelled and every block stays balanced."""
        block, position = divmod(index, NUM_CLASSES)
        group, block_in_group = divmod(block, NUM_CLASSES)
        start = _mix(_FLIP_LABEL_STREAM, self.seed, group) % NUM_CLASSES
        if self.train and (block_in_group - start) % NUM_CLASSES < self.recipe.label_noise_percent // 2:
            draw = _mix(_FLIP_LABEL_STREAM, self.seed, group, block_in_group)
            first = draw % NUM_CLASSES
            second = (first + 1 + (draw >> 8) % (NUM_CLASSES - 1)) % NUM_CLASSES
            if position == first:
                position = second
            elif position == second:
                position = first
        return self.clean_label(block * NUM_CLASSES + position)

    def pixels(self, index: int) -> torch.Tensor:
        """The uint8 (3, 32, 32) image of item ``index``, before normalisation."""
        r = self.recipe
        shape = _mix(_ITEM_STREAM, self.seed, self._split, index)
        look = _mix(_LOOK_STREAM, self.seed, self._split, index)
        parts = self._parts[self.clean_label(index)]
        primary = shape % r.parts
        secondary = (primary + 1 + (shape >> 4) % (r.parts - 1)) % r.parts
        mix = (shape >> 8) % (r.mix_sixteenths + 1)
        pattern = ((16 - mix) * parts[primary] + mix * parts[secondary]) // 16
        span = 2 * r.max_shift + 1
        low, high = r.scale_sixteenths
        rows = (self._zoom[low + (shape >> 16) % (high - low + 1)] + (shape >> 24) % span) % IMAGE_SIZE
        cols = (self._zoom[low + (shape >> 32) % (high - low + 1)] + (shape >> 40) % span) % IMAGE_SIZE
        pattern = pattern[:, rows[:, None], cols[None, :]]
        low, high = r.gain_sixteenths
        gain = torch.tensor([low + (look >> (8 * c)) % (high - low + 1) for c in range(3)], dtype=torch.int32)
        offset = torch.tensor(
            [(look >> (24 + 8 * c)) % (2 * r.max_offset + 1) - r.max_offset for c in range(3)],
            dtype=torch.int32,
        )
        low, high = r.clutter_sixteenths
        clutter_weight = low + (shape >> 48) % (high - low + 1)
        clutter = torch.roll(
            self._clutter[(look >> 48) % r.clutter_patterns],
            shifts=((look >> 54) % IMAGE_SIZE, (shape >> 56) % IMAGE_SIZE),
            dims=(1, 2),
        )
        noise = torch.randint(
            -r.noise_half_width,
            r.noise_half_width + 1,
            (3, IMAGE_SIZE, IMAGE_SIZE),
            generator=_generator(_NOISE_STREAM, self.seed, self._split, index),
            dtype=torch.int32,
        )
        pixels = (
            128 + offset.view(3, 1, 1) + (gain.view(3, 1, 1) * pattern + clutter_weight * clutter) // 16 + noise
        )
        return pixels.clamp_(0, 255).to(torch.uint8)


class InMemoryImages(Dataset):
    """Images held as one uint8 (N, 3, 32, 32) tensor, normalised when an item is fetched;
    `classes` names the labels."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, classes: tuple[str, ...] = CIFAR10_CLASSES) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(
                f"images must be uint8 (N, 3, H, W), got {images.dtype} {images.shape}"
            )
        if labels.shape != (images.shape[0],):
            raise ValueError(f"need one label per image, got {labels.shape} for {images.shape}")
        self.images = images
        self.labels = labels.to(torch.int64)
        self.classes = tuple(classes)

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return normalize(self.images[index]), int(self.labels[index])


def load_dataset(spec: DatasetSpec, *, train: bool) -> Dataset:
    """The training or test split named by ``spec``, cut to the requested size. Every dataset has
    ``classes``, the names of its labels."""
    if spec.name == "synthetic-hard":
        return SyntheticHardCIFAR10(train=train, size=spec.split_size(train=train), seed=spec.seed)
    if dataset_is_synthetic(spec):
        return SyntheticCIFAR10(train=train, size=spec.split_size(train=train), seed=spec.seed)
    if spec.imported:
        return _load_stored(spec, train=train)
    return _load_cifar10(spec, train=train)


def dataset_classes(spec: DatasetSpec) -> tuple[str, ...]:
    """The class names of the dataset ``spec`` names, in label order, without loading its images."""
    if dataset_is_synthetic(spec):
        return SYNTHETIC_CLASSES
    manifest = read_manifest(dataset_dir(spec.data_dir, spec.name))
    if manifest is None:
        if spec.imported:
            raise FileNotFoundError(_not_imported(spec))
        return CIFAR10_CLASSES
    return manifest.classes


def dataset_labels(dataset: Dataset) -> list[int]:
    """Every item's label, without building its image (generated sets compute labels alone)."""
    if isinstance(dataset, InMemoryImages):
        return dataset.labels.tolist()
    if isinstance(dataset, _GeneratedImages):
        return [dataset.label(i) for i in range(len(dataset))]
    return [int(dataset[i][1]) for i in range(len(dataset))]


def _not_imported(spec: DatasetSpec) -> str:
    return (f"dataset {spec.name!r} is not imported under {spec.data_dir!r}; on the gateway run "
            f"`edgetrain data import imagefolder DIR --name {spec.name} --data-dir {spec.data_dir}` (or `cifar "
            "PATH`), or serve with the --data-dir it was imported into")


def _cut(images, labels, spec: DatasetSpec, *, train: bool, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The first split_size samples, as tensors (ValueError when the split has fewer)."""
    size = spec.split_size(train=train, available=len(labels))
    if size > len(labels):
        split = "train" if train else "test"
        raise ValueError(f"requested {size} samples but the {what} {split} split has {len(labels)}")
    pixels = torch.from_numpy(np.ascontiguousarray(images[:size])).view(size, 3, IMAGE_SIZE, IMAGE_SIZE)
    return pixels, torch.from_numpy(labels[:size].astype(np.int64))


def _load_stored(spec: DatasetSpec, *, train: bool) -> InMemoryImages:
    """A dataset imported under its own name, read from its store and checked block by block."""
    directory = dataset_dir(spec.data_dir, spec.name)
    split = "train" if train else "test"
    try:
        manifest = read_manifest(directory)
        if manifest is None:
            raise FileNotFoundError(_not_imported(spec))
        images, labels = read_imported_split(directory, manifest, split)
    except DatasetImportError as e:
        raise FileNotFoundError(str(e)) from None
    pixels, targets = _cut(images, labels, spec, train=train, what=repr(spec.name))
    logger.info("[Data] loaded %r %s split: %d images of %d classes", spec.name, split, len(targets),
                len(manifest.classes))
    return InMemoryImages(pixels, targets, manifest.classes)


def _load_cifar10(spec: DatasetSpec, *, train: bool) -> InMemoryImages:
    """CIFAR-10 from ``spec.data_dir``: read with EdgeTrain's reader and checked against the
    manifest its import wrote; without one (a copy placed by torchvision, or ``spec.download``),
    torchvision's loader, which checks the official release's md5 sums."""
    directory = dataset_dir(spec.data_dir, CIFAR10)
    try:
        manifest = read_manifest(directory)
    except DatasetImportError as e:
        raise FileNotFoundError(str(e)) from None
    split = "train" if train else "test"
    if manifest is not None:
        try:
            images, labels = read_imported_split(directory, manifest, split)
        except DatasetImportError as e:
            raise FileNotFoundError(f"{e}; run `{import_command(CIFAR10, spec.data_dir)}` again") from None
        classes = manifest.classes
    elif spec.download or (directory / "data_batch_1").is_file():  # placed by torchvision: its md5-checked loader
        try:
            from torchvision import datasets  # imported on use: it adds ~1 s to start-up
        except ImportError:
            raise FileNotFoundError(f"CIFAR-10 under {spec.data_dir!r} has no manifest, and reading it without one "
                                    f"needs torchvision (pip install 'edgetrain[gateway]'): run "
                                    f"`{import_command(CIFAR10, spec.data_dir)}` instead") from None
        try:
            source = datasets.CIFAR10(root=spec.data_dir, train=train, download=spec.download)
        except RuntimeError as e:
            raise FileNotFoundError(f"CIFAR-10 under {spec.data_dir!r} is not the official release ({e}); run "
                                    f"`{import_command(CIFAR10, spec.data_dir)}`") from e
        images, labels = source.data.transpose(0, 3, 1, 2).reshape(len(source.data), -1), np.asarray(source.targets)
        classes = CIFAR10_CLASSES
    else:
        raise FileNotFoundError(
            f"CIFAR-10 not found under {spec.data_dir!r}; run `{import_command(CIFAR10, spec.data_dir)}`, or with "
            "download enabled when online (edgetrain ... --download), or use dataset name 'synthetic'")
    pixels, targets = _cut(images, labels, spec, train=train, what="CIFAR-10")
    logger.info("[Data] loaded CIFAR-10 %s split: %d images%s", split, len(targets),
                "" if manifest is None or manifest.official else " (not the official release's files)")
    return InMemoryImages(pixels, targets, classes)


def make_batch(
    dataset: Dataset, indices: Sequence[int], *, augment: bool, seed: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the items at ``indices`` (in that order) into ``(images, int64 labels)``.

    With ``augment``, each image gets a random crop (4-pixel zero padding) and horizontal flip
    drawn from ``(seed, step, index)`` alone, so a sample looks the same in whichever process
    and alongside whichever other samples it is batched.
    """
    if len(indices) == 0:
        raise ValueError("make_batch needs at least one index")
    items = [dataset[int(i)] for i in indices]
    images = torch.stack([image for image, _ in items])
    labels = torch.tensor([label for _, label in items], dtype=torch.int64)
    if augment:
        images = _crop_and_flip(images, [int(i) for i in indices], seed=seed, step=step)
    return images, labels


def _crop_and_flip(
    images: torch.Tensor, indices: list[int], *, seed: int, step: int
) -> torch.Tensor:
    """Random-crop (after zero padding) and maybe mirror each image, keyed by its index."""
    size, pad = images.shape[-1], CROP_PADDING
    draws = [_mix(_AUGMENT_STREAM, seed, step, index) for index in indices]
    top = torch.tensor([draw % (2 * pad + 1) for draw in draws])
    left = torch.tensor([(draw >> 8) % (2 * pad + 1) for draw in draws])
    flip = torch.tensor([bool((draw >> 16) & 1) for draw in draws])
    offsets = torch.arange(size)
    rows = top[:, None] + offsets
    cols = left[:, None] + torch.where(flip[:, None], offsets.flip(0), offsets)
    padded = F.pad(images, (pad, pad, pad, pad))
    batch = torch.arange(len(indices))[:, None, None]
    # Advanced indices around a slice move to the front: the result is (N, H, W, C).
    return padded[batch, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2).contiguous()
