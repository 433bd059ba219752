"""Parameters that arrive while the board computes (job key `training.stream_download`).

A data-parallel shard needs the whole model's parameters of this step (9 MB for MobileNetV2),
and downloading them first leaves the board's CPU idle while the coordinator serves them. The
coordinator serves them buffers first, then each block's parameters in the order the forward
pass meets them (edgetrain.training.state_tensors), so the download runs in a thread while the
board makes its batch; the compute waits only for the buffers (a few kB: compute_shard takes
the BatchNorm statistics it starts from before its first pass), and a forward pre-hook on each
block waits for that block's parameters and loads them before the block runs. Every block runs
on exactly the received values, so the arithmetic is that of downloading everything first.

What the board reports as its download time is the time it stood waiting for bytes (before the
compute and inside the forward pass), which is also taken out of its compute time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from edgetrain.models import BlockModel
from edgetrain.streaming import TensorMeta, TransferError, check_metas
from edgetrain.tensors import bundle_metas, unpack
from edgetrain.training import state_tensors

Download = Callable[..., tuple[list[TensorMeta], bytearray]]
"""The connection's parameter download: (version, base_version=None, prefixes=(), channels=None,
on_progress=None) -> bundle (edge_client.connection.CoordinatorConnection.download_parameters)."""


class ArrivingParameters:
    """A full parameter download of `version` under way in a thread, loaded into `model` block by
    block as the forward pass reaches each (:meth:`start`), then :meth:`finish`ed."""

    def __init__(self, model: BlockModel, download: Download, version: int) -> None:
        self._model = model
        self._version = version
        self._expected = bundle_metas(state_tensors(model))
        self._ends = {m.name: m.offset + m.nbytes for m in self._expected}
        self._targets = dict(model.named_buffers())
        self._targets.update(dict(model.named_parameters()))
        self._cond = threading.Condition()
        self._buffer: bytearray | None = None
        self._received = 0
        self._done = False
        self._error: BaseException | None = None
        self._result: tuple[list[TensorMeta], bytearray] | None = None
        self._loaded: set[str] = set()
        self._hooks: list = []
        self.waited_s = 0.0
        """Seconds the compute stood waiting for bytes (before it and inside the forward pass)."""
        self.seconds = 0.0
        """The download's own duration, once it has ended."""
        self.awaited: int | None = None
        """While the compute waits for bytes: the end of those it waits for (None otherwise)."""
        self._thread = threading.Thread(target=self._download, args=(download,), daemon=True,
                                        name=f"parameters-v{version}")
        self._thread.start()

    def start(self) -> None:
        """Load every buffer (waiting for them) and hook each block to load its parameters
        before it first runs."""
        self._load([name for name, _ in self._model.named_buffers()])
        for key, block in self._model.blocks.items():
            names = [f"blocks.{key}.{name}" for name, _ in block.named_parameters()]
            self._hooks.append(block.register_forward_pre_hook(lambda _m, _a, names=names: self._load(names)))

    def finish(self) -> tuple[list[TensorMeta], bytearray]:
        """Wait for the whole download; load what no block ran for; unhook. Its (metas, payload),
        or the download's error: a stream that broke after its last byte (the coordinator gone
        before the call ended) fails the step as a download that broke earlier does."""
        try:
            self._load(list(self._ends))
            self._thread.join()
            if self._result is None:  # the thread ended with its error instead
                raise self._error
            return self._result
        finally:
            self.close()

    def close(self) -> None:
        """Unhook (the download, if still under way, ends on its own and is dropped)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # --- internals -----------------------------------------------------------------------------------
    def _download(self, download: Download) -> None:
        started = time.perf_counter()
        try:
            metas, payload = download(self._version, on_progress=self._progress)
            self.seconds = time.perf_counter() - started
            self._progress(metas, payload, len(payload))  # checks the header unless progress already did
        except BaseException as e:  # handed to the compute, which raises it
            with self._cond:
                self._error, self._done = e, True
                self._cond.notify_all()
        else:
            with self._cond:
                self._result, self._done = (metas, payload), True
                self._cond.notify_all()

    def _progress(self, metas: list[TensorMeta], buffer: bytearray, received: int) -> None:
        with self._cond:
            if self._buffer is None:
                check_metas(metas, self._expected, f"parameters of version {self._version}")
                self._buffer = buffer
            self._received = received
            self._cond.notify_all()

    @torch.no_grad()
    def _load(self, names: list[str]) -> None:
        """Copy `names` into the model once their bytes are in (those not loaded yet)."""
        names = [n for n in names if n not in self._loaded]
        if not names:
            return
        end = max(self._ends[n] for n in names)
        started = time.perf_counter()
        with self._cond:
            self.awaited = end
            try:
                while self._error is None and not self._done and (self._buffer is None or self._received < end):
                    self._cond.wait()
            finally:
                self.awaited = None
            if self._error is not None:
                raise self._error
            buffer = self._buffer
        self.waited_s += time.perf_counter() - started
        if buffer is None:  # the download ended without a header: its error says why
            raise TransferError("data_loss", f"parameters of version {self._version}: no header")
        wanted = set(names)
        for name, tensor in unpack([m for m in self._expected if m.name in wanted], buffer).items():
            self._targets[name].copy_(tensor)
        self._loaded.update(names)
