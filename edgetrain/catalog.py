"""What a job can name — models, datasets, codecs — and the specs that pick them, without torch.

Job configuration (``config/``) is checked against these names and specs, so a command that
only reads or validates a job (``edgetrain submit``, ``edgetrain plan`` with cached measurements)
never imports torch. The modules that build what is named here need torch and use these names:
``models.py`` builds a model of ``MODEL_NAMES``, ``data.py`` loads a ``DatasetSpec``,
``compression.py`` encodes with a ``CodecSpec``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MODEL_NAMES: tuple[str, ...] = ("resnet18", "mobilenet_v2", "small_cnn")
"""Names accepted by ``edgetrain.models.build_model``."""

DATASET_NAMES: tuple[str, ...] = ("synthetic", "synthetic-hard", "cifar10")
"""The built-in datasets. ``DatasetSpec.name`` also takes the name of a dataset imported on the
gateway (`edgetrain data import cifar|imagefolder ... --name NAME`)."""
IMPORTED_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
"""What the name of an imported dataset looks like (edgetrain.datastore checks it at import)."""

SYNTHETIC_DATASET_NAMES: tuple[str, ...] = ("synthetic", "synthetic-hard")
"""The generated datasets: everything printed or plotted from them must say "synthetic"."""

FULL_TRAIN_SIZE = 50_000
"""Samples in the training split (CIFAR-10's, which the synthetic dataset copies)."""
FULL_TEST_SIZE = 10_000
"""Samples in the test split."""

SYNTHETIC_HARD_TRAIN_SIZE = 5_000
"""Training samples experiments use with ``synthetic-hard`` (set explicitly as ``train_size``:
a spec without one still means the full 50000)."""
SYNTHETIC_HARD_TEST_SIZE = 1_000
"""Test samples experiments use with ``synthetic-hard``."""
SYNTHETIC_HARD_TARGET = 0.70
"""Test accuracy that experiments and the time-to-accuracy benchmark stop at on ``synthetic-hard``
at the sizes above: MobileNetV2 needs several epochs to pass it (docs/calibration.md)."""

SMALL_CNN_HARD_TRAIN_SIZE = 50_000
"""Training samples of the time-to-accuracy benchmark's `small` job (the small CNN on
``synthetic-hard``): at 5000 the small CNN plateaus at 0.89-0.93."""
SMALL_CNN_HARD_LR = 0.02
"""The `small` job's learning rate (momentum 0.9, constant after warm-up)."""
SMALL_CNN_HARD_TARGET = 0.95
"""Test accuracy the `small` job stops at, calibrated for one 0.5-core board alone to need about 5
minutes (docs/calibration.md: 250-259 s on 2026-12-05)."""

CODEC_NAMES: tuple[str, ...] = ("none", "fp16", "bf16", "int8", "topk", "powersgd")
"""Names accepted by ``CodecSpec.name``."""

DEFAULT_TOPK_RATIO = 0.01
DEFAULT_POWERSGD_RANK = 4
"""Rank of PowerSGD's factors when ``powersgd`` names none (Vogels et al. 2019 train CIFAR
ResNet-18 at rank 2-4 close to full precision)."""
"""Fraction of elements top-k keeps when the spec gives no ratio (``topk``)."""

_CODEC_FORMS = ("none, fp16, bf16, int8, topk, topk:<ratio> with 0 < ratio <= 1 (e.g. topk:0.01), powersgd, or "
                "powersgd:<rank> with an integer rank >= 1 (e.g. powersgd:4)")


@dataclass(kw_only=True, frozen=True)
class DatasetSpec:
    """Which dataset a job trains on, and how much of it."""

    name: str
    """``"synthetic"`` or ``"synthetic-hard"`` (generated on the fly, nothing on disk; the hard tier
    separates training methods, see docs/calibration.md), ``"cifar10"``, or the name of a dataset
    imported on the gateway (`edgetrain data import imagefolder|cifar PATH --name NAME`)."""
    data_dir: str = "data"
    """Directory holding the imported datasets (and CIFAR-10's python batches)."""
    download: bool = False
    """Download CIFAR-10 into ``data_dir`` when it is missing (needs network access)."""
    seed: int = 0
    """Seed of the synthetic dataset; every process with the same seed sees the same images."""
    train_size: int | None = None
    """Training samples to use: the first N (None: the whole split; 50000 for generated data)."""
    test_size: int | None = None
    """Test samples to use: the first N (None: the whole split; 10000 for generated data)."""
    augment: bool = True
    """Random crop (4-pixel zero padding) and horizontal flip on training batches."""

    def __post_init__(self) -> None:
        if self.name not in DATASET_NAMES and not (isinstance(self.name, str) and IMPORTED_NAME.fullmatch(self.name)):
            raise ValueError(
                f"unknown dataset {self.name!r}; valid names: {', '.join(DATASET_NAMES)}, or the name of a "
                "dataset imported on the gateway (lower-case letters, digits, '.', '_', '-')"
            )
        for field in ("train_size", "test_size"):
            size = getattr(self, field)
            if size is not None and size <= 0:
                raise ValueError(f"{field} must be > 0 (or None for the full split), got {size}")

    @property
    def imported(self) -> bool:
        """Whether the dataset was imported on the gateway under a name of its own (not built in)."""
        return self.name not in DATASET_NAMES

    def split_size(self, *, train: bool, available: int | None = None) -> int:
        """Number of samples to use from the training or test split (`available`: the split's size,
        what an unset size means; generated data has 50000 and 10000)."""
        size = self.train_size if train else self.test_size
        if size is not None:
            return size
        if available is not None:
            return available
        return FULL_TRAIN_SIZE if train else FULL_TEST_SIZE


def dataset_is_synthetic(spec: DatasetSpec) -> bool:
    """Whether ``spec`` names generated data, which reports must label as synthetic."""
    return spec.name in SYNTHETIC_DATASET_NAMES


@dataclass(frozen=True)
class CodecSpec:
    """Which codec compresses a bundle; ``str(spec)`` is the text `parse_codec` reads back."""

    name: str
    """One of `CODEC_NAMES`."""
    ratio: float = DEFAULT_TOPK_RATIO
    """Top-k only: fraction of each tensor's elements kept, in (0, 1]."""
    rank: int = DEFAULT_POWERSGD_RANK
    """PowerSGD only: rank of the low-rank factors, >= 1."""

    def __post_init__(self) -> None:
        if self.name not in CODEC_NAMES:
            raise ValueError(f"unknown codec {self.name!r}; valid names: {', '.join(CODEC_NAMES)}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)):
            raise ValueError(f"codec ratio must be a number, got {self.ratio!r}")
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"codec ratio must be in (0, 1], got {self.ratio!r}")
        if self.name != "topk" and self.ratio != DEFAULT_TOPK_RATIO:
            raise ValueError(f"codec {self.name!r} takes no ratio (only topk does), got {self.ratio!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"codec rank must be an integer >= 1, got {self.rank!r}")
        if self.name != "powersgd" and self.rank != DEFAULT_POWERSGD_RANK:
            raise ValueError(f"codec {self.name!r} takes no rank (only powersgd does), got {self.rank!r}")

    def __str__(self) -> str:
        if self.name == "topk":
            return f"topk:{float(self.ratio)!r}"
        return f"powersgd:{self.rank}" if self.name == "powersgd" else self.name

    @property
    def lossy(self) -> bool:
        """Whether decode(encode(x)) can differ from x (everything but ``none``)."""
        return self.name != "none"


def parse_codec(text: str) -> CodecSpec:
    """The spec written as ``none``, ``fp16``, ``bf16``, ``int8``, ``topk``, ``topk:<ratio>``,
    ``powersgd`` or ``powersgd:<rank>``."""
    if not isinstance(text, str):
        raise ValueError(f"bad codec {text!r}: not a string; expected {_CODEC_FORMS}")
    name, sep, arg = text.partition(":")
    if name not in CODEC_NAMES or (sep and name not in ("topk", "powersgd")):
        raise ValueError(f"bad codec {text!r}; expected {_CODEC_FORMS}")
    if ":" in arg:
        raise ValueError(f"bad codec {text!r}: more than one ':'; expected {_CODEC_FORMS}")
    if not sep:
        return CodecSpec(name)
    if name == "powersgd":
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"bad codec {text!r}: rank {arg!r} is not an integer >= 1; expected {_CODEC_FORMS}")
        return CodecSpec(name, rank=int(arg))
    try:
        ratio = float(arg)
    except ValueError:
        raise ValueError(
            f"bad codec {text!r}: ratio {arg!r} is not a number; expected {_CODEC_FORMS}"
        ) from None
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"bad codec {text!r}: ratio {arg} is not in (0, 1]; expected {_CODEC_FORMS}")
    return CodecSpec(name, ratio)
