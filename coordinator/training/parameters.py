"""The parameters boards download: full versions, and compressed deltas between versions.

With downlink `none` the served parameters are the master's, packed once per version. With a
lossy downlink codec the store keeps a *view* (see edgetrain.updates): each new version's delta
master - view is encoded once, the view advances by exactly what boards will decode, and the
encoded deltas of the last `keep` versions are kept, so a board one or a few versions behind
downloads only those (a few percent of the bytes). Older bases get the full view.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping

import torch

from coordinator.training.steps import StepError
from edgetrain.compression import CodecSpec, parse_codec
from edgetrain.errors import Refusal
from edgetrain.pipeline import channel_bounds
from edgetrain.streaming import TensorMeta
from edgetrain.tensors import pack, unpack
from edgetrain.updates import DeltaFormat


class ParameterStore:
    """Thread-safe: the trainer publishes, RPC handlers read."""

    def __init__(self, downlink: str = "none", *, keep: int = 8, keep_full: int = 1,
                 split: Mapping[str, int] | None = None) -> None:
        self._split = dict(split or {})
        """Parameters a channel group splits, with their output channels (edgetrain.channels)."""
        self.delta_spec: CodecSpec | None = None if downlink in ("", "none") else parse_codec(downlink)
        self._keep = keep
        self._keep_full = keep_full
        self._old: OrderedDict[int, tuple[list[TensorMeta], memoryview]] = OrderedDict()
        self._lock = threading.Lock()
        self._version = -1
        self._publication = 0
        self._full: tuple[list[TensorMeta], memoryview] | None = None
        self._view: dict[str, torch.Tensor] | None = None
        self._format: DeltaFormat | None = None
        self._deltas: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._chains: OrderedDict[tuple[int, int], tuple[list[TensorMeta], memoryview]] = OrderedDict()

    @property
    def publication(self) -> int:
        """Counts publications: changes whenever what is served changes (even the same version
        published again, e.g. after owned pipeline blocks came back)."""
        with self._lock:
            return self._publication

    @property
    def version(self) -> int:
        """The version currently served (-1 before the first)."""
        with self._lock:
            return self._version

    def publish(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """Serve `state` (the master's parameters and buffers) as `version`."""
        with self._lock:
            if self._keep_full > 1 and 0 <= self._version != version:  # late boards may fetch older versions
                self._old[self._version] = self._full or pack(self._view)
                while len(self._old) >= self._keep_full:
                    self._old.popitem(last=False)
            if self.delta_spec is None:
                self._full = pack(state)
            elif self._view is None or version != self._version + 1:  # first version, or after a resume
                self._view = {n: t.detach().clone() for n, t in state.items()}
                self._format = self._format or DeltaFormat(self._view, self.delta_spec)
                self._deltas.clear()
                self._full = None
            else:
                self._deltas[version] = self._format.encode(state, self._view)
                while len(self._deltas) > self._keep:
                    self._deltas.popitem(last=False)
                self._full = None
            self._version = version
            self._publication += 1
            self._chains.clear()

    def full(self, version: int) -> tuple[list[TensorMeta], memoryview]:
        """Metas and payload of the whole served state at `version` (the current one, or one of
        the `keep_full` - 1 before it)."""
        with self._lock:
            if version in self._old:
                return self._old[version]
            self._check(version)
            if self._full is None:
                self._full = pack(self._view)
            return self._full

    def part(self, version: int, prefixes: tuple[str, ...],
             share: tuple[float, float] | None = None) -> tuple[list[TensorMeta], memoryview]:
        """The served tensors of `version` whose names start with one of `prefixes` (a stage's);
        with a channel group member's `share`, only its rows of the split parameters."""
        with self._lock:
            if version not in self._old:
                self._check(version)
            key = ("part", version, prefixes, share)
            if key not in self._chains:
                metas, payload = self._old.get(version) or self._full or pack(self._view)
                tensors = unpack(metas, payload)
                chosen = {n: t for n, t in tensors.items() if n.startswith(prefixes)}
                if not chosen:
                    raise StepError("not_found", f"no parameters start with {list(prefixes)}")
                if share is not None:
                    chosen = {n: t[slice(*channel_bounds(self._split[n], share))] if n in self._split else t
                              for n, t in chosen.items()}
                self._chains[key] = pack(chosen)
                while len(self._chains) > 16:
                    self._chains.popitem(last=False)
            return self._chains[key]

    def deltas(self, base: int, version: int) -> tuple[list[TensorMeta], memoryview]:
        """The encoded deltas base+1 .. version, chained in one bundle."""
        with self._lock:
            if version not in self._old:
                self._check(version)
            if self.delta_spec is None:
                raise StepError("failed_precondition", "this job's downlink sends full parameters, not deltas",
                                Refusal.DELTAS_NOT_KEPT)
            if base >= version:
                raise StepError("invalid_argument", f"base_version {base} must be older than version {version}")
            if not all(u in self._deltas for u in range(base + 1, version + 1)):
                kept = f"{min(self._deltas)}..{max(self._deltas)}" if self._deltas else "none"
                raise StepError("failed_precondition", f"deltas from version {base} to {version} are not kept "
                                f"(kept: deltas to versions {kept}); download full parameters", Refusal.DELTAS_NOT_KEPT)
            key = (base, version)
            if key not in self._chains:
                chain = {}
                for u in range(base + 1, version + 1):
                    chain.update({f"v{u}/{n}": t for n, t in self._deltas[u].items()})
                self._chains[key] = pack(chain)
                while len(self._chains) > 4:
                    self._chains.popitem(last=False)
            return self._chains[key]

    def _check(self, version: int) -> None:
        if version != self._version:
            raise StepError("failed_precondition",
                            f"parameter version {version} is not served; current version is {self._version}",
                            Refusal.VERSION_NOT_SERVED)
