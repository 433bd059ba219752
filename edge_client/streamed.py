"""An update streamed while backward runs: gradients go on the wire as backward produces them.

DDP hides its all-reduce behind backward by launching each bucket of gradients as soon as it is
ready; a board does the same with its upload. An uncompressed update's wire layout is fixed
before compute (edgetrain.updates.UpdateFormat: gradients last layer first, then the float
buffers), so the upload's header leaves before the forward pass; a hook on every parameter copies
its gradient into its slot of the payload once backward has accumulated it (in the last chunk's
backward, when a shard goes through the model in chunks), and the stream sends each chunk as soon
as every byte of it is final. The buffers (BatchNorm running statistics) follow when compute
ends, the step report last. The bytes are exactly those of the update packed after compute.

On a link slower than the board's backward most of the upload is hidden; on a board whose CPU
quota is the bottleneck the transfer's CPU still comes out of the same quota.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace

import torch

from edgetrain.streaming import RawChunk, TensorMeta, UploadAbandoned, iter_chunks
from edgetrain.training import GRAD_PREFIX
from edgetrain.work import STREAM_MODES, StepReport


class StreamedUpdate:
    """One step's update, filled by backward hooks and sent by an upload thread at the same time.

    Lifecycle: `start(send)` (before compute: hooks registered, `send(self)` running in a
    thread), `arm()` (before the last backward), `complete(tensors)` (after compute: every slot
    filled, hooks removed), `send_report(report)`, then `wait()`; `abandon()` at any point ends it.
    """

    def __init__(self, model: torch.nn.Module, metas: Sequence[TensorMeta]) -> None:
        self.metas = list(metas)
        self.nbytes = sum(m.nbytes for m in self.metas)
        self._payload = bytearray(self.nbytes)
        self._slots: list[torch.Tensor] = []
        for meta in self.metas:
            if meta.dtype != "float32":
                raise ValueError(f"a streamed update carries float32 tensors, not {meta.dtype} ({meta.name})")
            self._slots.append(torch.frombuffer(self._payload, dtype=torch.float32, offset=meta.offset,
                                                count=meta.nbytes // 4).view(meta.shape) if meta.nbytes
                               else torch.empty(meta.shape))
        index = {m.name: i for i, m in enumerate(self.metas)}
        self._params = [(index[GRAD_PREFIX + name], p) for name, p in model.named_parameters()
                        if GRAD_PREFIX + name in index]
        self._filled = [False] * len(self.metas)
        self._next = 0
        """First slot, in wire order, not filled yet: every byte before its offset is final."""
        self._ready = 0
        self._wanted = 0
        """The byte the upload thread waits for: backward wakes it only once that one is final
        (one wake-up per chunk rather than per parameter)."""
        self._cond = threading.Condition()
        self._armed = False
        self._hooks: list = []
        self._report: StepReport | None = None
        self._completed_at: float | None = None
        self._abandoned = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- the compute side --------------------------------------------------------------------

    def start(self, send: Callable[[StreamedUpdate], None]) -> None:
        """Register the gradient hooks and start `send(self)` (the upload RPC) in a thread."""
        for i, param in self._params:
            self._hooks.append(param.register_post_accumulate_grad_hook(
                lambda p, i=i: self._fill(i, p.grad) if self._armed else None))

        def run() -> None:
            try:
                send(self)
            except BaseException as e:  # handed to wait()
                self._error = e

        self._thread = threading.Thread(target=run, daemon=True, name="streamed-upload")
        self._thread.start()

    def arm(self) -> None:
        """The next backward is the last: its accumulated gradients are final."""
        self._armed = True

    def complete(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Compute ended: fill what backward did not (unused parameters, buffers) from `tensors`."""
        self._remove_hooks()
        for i, meta in enumerate(self.metas):
            if not self._filled[i]:
                self._fill(i, tensors[meta.name])
        with self._cond:
            self._completed_at = time.perf_counter()

    def send_report(self, report: StepReport) -> None:
        """The step report, sent after the last chunk (with how long the upload ran past compute)."""
        with self._cond:
            self._report = report
            self._cond.notify_all()

    def abandon(self) -> None:
        """Send nothing more: the stream ends without its report (the coordinator keeps no update)."""
        self._remove_hooks()
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()

    @property
    def abandoned(self) -> bool:
        """Whether `abandon` was called."""
        return self._abandoned

    def wait(self) -> None:
        """Until the upload ended; re-raises what ended it badly."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error

    def _remove_hooks(self) -> None:
        self._armed = False
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _fill(self, i: int, value: torch.Tensor | None) -> None:
        slot = self._slots[i]
        if value is None:
            slot.zero_()
        else:
            slot.copy_(value.detach().reshape(slot.shape))
        with self._cond:
            self._filled[i] = True
            while self._next < len(self.metas) and self._filled[self._next]:
                meta = self.metas[self._next]
                self._ready = meta.offset + meta.nbytes
                self._next += 1
            if self._ready >= self._wanted:
                self._cond.notify_all()

    # -- the upload side ---------------------------------------------------------------------

    def chunks(self, start: int, chunk_bytes: int, checksum: bool = True) -> Iterator[RawChunk]:
        """Chunks from byte `start` on (with crc32s unless not `checksum`), each once all its
        bytes are final; UploadAbandoned if the update is abandoned before the last one."""
        view = memoryview(self._payload)
        offset = start
        while offset < self.nbytes:
            end = min(offset + chunk_bytes, self.nbytes)
            with self._cond:
                self._wanted = end
                self._cond.wait_for(lambda end=end: self._ready >= end or self._abandoned)
                if self._abandoned:
                    raise UploadAbandoned()
            yield from iter_chunks(view[:end], start=offset, chunk_bytes=chunk_bytes, checksum=checksum)
            offset = end

    def report(self) -> StepReport:
        """The step report once given, with `upload_exposed_s` (compute's end to now, when every
        chunk went out); UploadAbandoned if the update is abandoned first."""
        with self._cond:
            self._cond.wait_for(lambda: self._report is not None or self._abandoned)
            if self._abandoned:
                raise UploadAbandoned()
            exposed = time.perf_counter() - (self._completed_at or time.perf_counter())
            return replace(self._report, upload_exposed_s=max(0.0, exposed))


class StreamChoice:
    """Whether the board's next uncompressed update streams (or, for `training.stream_download`,
    its next full parameter download runs under its compute), under the job's "on", "off" or "auto".

    Overlap hides the part of an upload (a download) spent waiting on the link. The part spent on the board's
    own CPU (copying, framing, encrypting) comes out of the CPU backward needs, and streaming adds
    a hook per parameter and thread hand-offs on top: on the emulated fleet's loopback links,
    where a board's transfers are bound by its CPU quota, streaming every update gained nothing
    (docs/benchmarks.md#dp). So "auto" sends whole
    updates and times them: an upload during which the process used less than `LINK_BOUND_SHARE`
    (a quarter) of the CPU the board had (wall seconds x its cores, or its emulated fraction of one) waited
    mostly on something other than the board — its link, or a coordinator busy serving many boards
    (streaming hides either wait behind backward) — and the board streams the updates that follow,
    sending one whole again every `RECHECK_EVERY` to see whether the transfer still waits elsewhere.
    """

    LINK_BOUND_SHARE = 0.25
    """At most this share of the CPU the board had during a whole upload, and the upload waited on
    the link. Not 0.5: an upload's wall time includes the coordinator's checks before it replies,
    which streaming does not hide either; at 0.5 the 0.5-core board of the loopback fleet (9 MB in
    ~40 ms) counted as link-bound."""
    RECHECK_EVERY = 20

    def __init__(self, mode: str, cores: float, key: str = "stream_upload") -> None:
        if mode not in STREAM_MODES:
            raise ValueError(f"{key} must be on, off or auto, not {mode!r}")
        self.mode = mode
        self.cores = cores
        self.link_bound: bool | None = None
        """What the last whole upload showed: it waited on the link or the coordinator, not on the
        board's CPU (None: none measured yet)."""
        self._streamed_since = 0

    def stream(self) -> bool:
        """Whether the next eligible update streams."""
        if self.mode != "auto":
            return self.mode == "on"
        return bool(self.link_bound) and self._streamed_since < self.RECHECK_EVERY

    def observe(self, *, streamed: bool, wall_s: float, cpu_s: float) -> None:
        """One uncompressed upload ended: `wall_s` long, the process using `cpu_s` of CPU meanwhile
        (a streamed upload's times are compute's too: it only counts towards the next check)."""
        if streamed:
            self._streamed_since += 1
            return
        self._streamed_since = 0
        if wall_s > 0:
            self.link_bound = cpu_s < self.LINK_BOUND_SHARE * wall_s * self.cores
