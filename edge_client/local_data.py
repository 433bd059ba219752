"""A board's own images (`edgetrain client --local-data DIR`): decoded once, trained on, never sent.

DIR is an image folder on the board (edgetrain/image_folder.py: one sub-folder per class; a
board's camera may see a single class). At start the board decodes it once into a store in its
data directory (``DATA_DIR/local/<digest of DIR's path>/``, edgetrain/datastore.py) and decodes
it again only when the folder changed (a file added, removed, resized or touched): every image
counts. When it joins a job it maps its class folders onto the job's classes by name — a class
the job's dataset does not have is refused in one line before the board trains — and reports its
sample count and, unless the job says ``privacy.class_counts: false``, its samples per class.
The coordinator then names indices into these samples; they never leave the board (what does:
docs/design.md, "Data that stays on the board").

Before every step the board checks that DIR is still there and readable: a board whose data
was removed (a card pulled, a folder deleted) leaves the job with that reason instead of
training on a copy the user took away.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

from edgetrain.config import ConfigError
from edgetrain.data import InMemoryImages
from edgetrain.datastore import (
    DatasetImportError,
    read_manifest,
    read_store_split,
    write_store,
)
from edgetrain.image_folder import decode_files, scan_classes

logger = logging.getLogger(__name__)

LOCAL_DIR = "local"
"""Where under the board's data directory its decoded images are kept."""
FINGERPRINT_FILE = "source.json"


class LocalDataError(ConfigError):
    """The board's own data cannot be used (for this job, or at all); one line saying why."""


class LocalDataGone(LocalDataError):
    """The board's own data disappeared or became unreadable while it trained."""


def _fingerprint(files) -> str:
    """A digest of the image files' relative paths, sizes and modification times."""
    digest = hashlib.sha256()
    for path, label in files:
        stat = path.stat()
        digest.update(f"{path}\0{label}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


class LocalData:
    """An image folder on the board, decoded into its data directory (see the module docstring)."""

    def __init__(self, root: str | Path, data_dir: str | Path) -> None:
        self.root = Path(root).resolve()
        key = hashlib.sha256(str(self.root).encode()).hexdigest()[:16]
        self.store = Path(data_dir) / LOCAL_DIR / key
        self.classes: tuple[str, ...] = ()
        self.images: torch.Tensor | None = None
        self.labels: np.ndarray | None = None

    def prepare(self) -> LocalData:
        """Decode the folder (or read the store decoded from it before, if it is unchanged);
        LocalDataError in one line when the folder cannot be used."""
        try:
            folders = scan_classes(self.root, min_classes=1)
            fingerprint = _fingerprint(folders.files)
            manifest = self._stored(fingerprint)
            if manifest is None:
                images, labels, _ = decode_files(folders.files)
                manifest = write_store(self.store, "local", {"train": (images, labels)}, folders.classes,
                                       min_classes=1, extra={"source": str(self.root)})
                (self.store / FINGERPRINT_FILE).write_text(json.dumps({"fingerprint": fingerprint}))
                logger.info("[Client.Data] decoded %d images of %d classes from %s into %s", len(labels),
                            len(folders.classes), self.root, self.store)
            images, labels = read_store_split(self.store, manifest, "train")
        except DatasetImportError as e:
            raise LocalDataError(f"--local-data: {e}") from None
        except OSError as e:
            raise LocalDataError(f"--local-data {self.root}: cannot read it ({e.strerror or e})") from None
        self.classes = manifest.classes
        self.images = torch.from_numpy(images.copy()).view(len(labels), 3, 32, 32)
        self.labels = labels
        return self

    def _stored(self, fingerprint: str):
        """The store's manifest when it was decoded from the folder as it is now, else None."""
        try:
            stored = json.loads((self.store / FINGERPRINT_FILE).read_text())
            if stored.get("fingerprint") == fingerprint:
                return read_manifest(self.store)
        except (OSError, ValueError, DatasetImportError):
            pass
        return None

    @property
    def samples(self) -> int:
        return 0 if self.labels is None else len(self.labels)

    def for_job(self, job_classes: tuple[str, ...]) -> InMemoryImages:
        """The board's images labelled with the job's class indices (LocalDataError naming the
        first class the job's dataset does not have)."""
        index = {name: i for i, name in enumerate(job_classes)}
        unknown = [name for name in self.classes if name not in index]
        if unknown:
            listed = ", ".join(job_classes[:12]) + (", ..." if len(job_classes) > 12 else "")
            raise LocalDataError(f"--local-data {self.root}: class {unknown[0]!r} (folder {self.root / unknown[0]}) "
                                 f"is not one of the job's {len(job_classes)} classes ({listed}); the gateway's "
                                 "test set must know every class a board trains on")
        mapping = torch.tensor([index[name] for name in self.classes], dtype=torch.int64)
        return InMemoryImages(self.images, mapping[torch.from_numpy(self.labels.astype(np.int64))], job_classes)

    def class_counts(self, job_classes: tuple[str, ...]) -> tuple[int, ...]:
        """Its samples per class of the job, in the job's class order."""
        counts = np.bincount(self.labels, minlength=len(self.classes))
        mine = dict(zip(self.classes, counts.tolist()))
        return tuple(int(mine.get(name, 0)) for name in job_classes)

    def check(self) -> None:
        """LocalDataGone when the folder is no longer there or readable."""
        try:
            if not self.root.is_dir() or not os.access(self.root, os.R_OK | os.X_OK):
                raise LocalDataGone(f"its own data at {self.root} is gone or unreadable")
        except OSError as e:
            raise LocalDataGone(f"its own data at {self.root} is unreadable ({e.strerror or e})") from None

