"""What a pipeline stage host exchanges with its peers in one step (edge_client.stage).

`Outbox` holds the step's sends to neighbouring stages and channel group members: each starts in
the background on the StagePeer endpoint, is counted, checked while the host waits for a peer
(a failed send ends the wait), and drained at the end of the step within the stage timeout, or
cancelled when the step fails. `GroupExchange` is a channel group's exchange
(edgetrain.channels.Exchange): each member's slice of a split layer's output, and its partial
input gradient, goes to every other member through the same endpoints.
"""

from __future__ import annotations

import time
from concurrent import futures

import torch

from edge_client.endpoint import MailKey, StageEndpoint, StageFailure
from edgetrain.errors import FailureKind
from edgetrain.training import DeviceCopies
from edgetrain.work import Assignment


class Outbox:
    """A step's sends to peers: started in the background, counted, checked while waiting, and
    drained (or cancelled) at the end."""

    def __init__(self, endpoint: StageEndpoint, job_id: str, work: Assignment) -> None:
        self.endpoint, self.job_id, self.work = endpoint, job_id, work
        self.futures: list[futures.Future] = []
        self.bytes_sent = 0
        """Bytes of activations and gradients sent."""

    def send(self, address: str, key: MailKey, tensor: torch.Tensor) -> None:
        """Start shipping `tensor` (what `key` says it is) to the peer at `address`."""
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self.futures.append(self.endpoint.send(address, self.job_id, key, tensor, self.work.stage.timeout_s))

    def check(self) -> None:
        """Raise the error of a send that failed."""
        for future in self.futures:
            if future.done() and future.exception() is not None:
                raise future.exception()

    def drain(self) -> float:
        """Wait for every send to finish, giving up at the stage timeout or when the coordinator
        closed the attempt; the seconds waited."""
        work, timeout_s = self.work, self.work.stage.timeout_s
        started = time.perf_counter()
        deadline = started + timeout_s
        for future in self.futures:
            while True:
                try:
                    future.result(timeout=0.5)
                    break
                except futures.TimeoutError:
                    if self.endpoint.mailbox.superseded(work.step, work.attempt):
                        raise StageFailure(FailureKind.SUPERSEDED, f"step {work.step} attempt {work.attempt} was closed by the "
                                           "coordinator while sending to a neighbouring stage") from None
                    if time.perf_counter() > deadline:
                        raise StageFailure(FailureKind.NEIGHBOUR_TIMEOUT, f"sending to a neighbouring stage did not finish within "
                                           f"{timeout_s:g} s") from None
        return time.perf_counter() - started

    def cancel(self) -> None:
        """Cancel the sends not yet started (the step failed)."""
        for future in self.futures:
            future.cancel()


class GroupExchange:
    """A channel group's exchanges (edgetrain.channels.Exchange) through the members' StagePeer
    endpoints: each message goes to every other member, keyed by the split-layer call it belongs to."""

    def __init__(self, endpoint: StageEndpoint, work: Assignment, device_id: str, me: int, outbox: Outbox,
                 copies: DeviceCopies) -> None:
        self.endpoint, self.work, self.device_id, self.me = endpoint, work, device_id, me
        self.outbox, self.copies = outbox, copies
        self.group = work.stage.hosts
        self.wait_s = 0.0
        """Seconds spent waiting for the other members' tensors."""

    def _key(self, m: int, tag: int, backward: bool, rows: int, device_id: str) -> MailKey:
        st = self.work.stage
        return MailKey(self.work.step, self.work.attempt, st.pipeline, m, backward, st.stage, 0, rows, device_id, tag)

    def _send(self, m: int, tag: int, backward: bool, tensor: torch.Tensor, to: list[int]) -> None:
        key = self._key(m, tag, backward, tensor.shape[0], self.device_id)
        tensor = self.copies.to_host(tensor)
        for j in to:
            self.outbox.send(self.group[j].address, key, tensor)

    def _take(self, m: int, tag: int, backward: bool, rows: int, j: int) -> torch.Tensor:
        started = time.perf_counter()
        host = self.group[j]
        what = (f"{'input gradient' if backward else 'output channels'} of split layer {tag} of micro-batch {m} "
                f"from channel group member {host.name or host.device_id}")
        try:
            return self.copies.to_device(self.endpoint.mailbox.take(self._key(m, tag, backward, rows, host.device_id),
                                                                    self.work.stage.timeout_s, what, self.outbox.check))
        finally:
            self.wait_s += time.perf_counter() - started

    def gather(self, microbatch: int, tag: int, local: torch.Tensor, bounds, dim: int) -> torch.Tensor:
        """A split layer's whole output: this member's channels `local` with every other member's."""
        if bounds[self.me][1] > bounds[self.me][0]:
            self._send(microbatch, tag, False, local, [j for j in range(len(self.group)) if j != self.me])
        parts = []
        for j, (lo, hi) in enumerate(bounds):
            if hi <= lo:
                continue
            part = local if j == self.me else self._take(microbatch, tag, False, local.shape[0], j)
            want = list(local.shape)
            want[dim] = hi - lo
            if list(part.shape) != want:
                raise ValueError(f"output channels of split layer {tag} from channel group member "
                                 f"{self.group[j].name or self.group[j].device_id}: shape {list(part.shape)}, "
                                 f"expected {want}")
            parts.append(part)
        return torch.cat(parts, dim=dim)

    def all_reduce(self, microbatch: int, tag: int, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every member's partial input gradient of a split layer, in member order."""
        self._send(microbatch, tag, True, partial, [j for j in range(len(self.group)) if j != self.me])
        parts = [partial if j == self.me else self._take(microbatch, tag, True, partial.shape[0], j)
                 for j in range(len(self.group))]
        for j, part in enumerate(parts):
            if part.shape != partial.shape:
                raise ValueError(f"input gradient of split layer {tag} from channel group member "
                                 f"{self.group[j].name or self.group[j].device_id}: shape {list(part.shape)}, "
                                 f"expected {list(partial.shape)}")
        total = parts[0].clone()  # the same order on every member: the same sum, bit for bit
        for part in parts[1:]:
            total += part
        return total
