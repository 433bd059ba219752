"""An in-process coordinator without a trainer: a real CoordinatorServicer on 127.0.0.1:0.

Wired as coordinator.main wires it (DeviceRegistry, StepBoard, ParameterStore, the Aggregator's
view of the job, coordinator.pairing.serve_gateway); the test plays the trainer, opening step
attempts on the StepBoard itself. Plaintext by default (the servicer's own checks); with an
`authority`, mutual TLS and a pairing port exactly as a coordinator serves them.
test_servicer.py, test_coordinator_trust.py, test_connection.py and test_worker.py run their
clients against it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from coordinator.main import board_job
from coordinator.pairing import GatewayServer, serve_gateway
from coordinator.registry import DeviceRegistry
from coordinator.servicer import CoordinatorServicer, coordinator_service
from coordinator.training.aggregator import Aggregator
from coordinator.training.parameters import ParameterStore
from coordinator.training.steps import AttemptOutcome, StepBoard
from edgetrain import trust
from edgetrain.config import JobConfig
from edgetrain.models import build_model
from edgetrain.training import shard_tensor_names, state_tensors
from edgetrain.updates import UpdateFormats
from edgetrain.work import Assignment, BoardJob

SAMPLES = tuple(range(0, 480, 20))
"""24 samples spread over the 512 of the small job's synthetic training set."""


@dataclass
class InProcessCoordinator:
    """A CoordinatorServicer served on 127.0.0.1 in this process; the test plays the trainer."""

    job: JobConfig
    model: nn.Module
    """The master model; version 0 of the store is its state."""
    registry: DeviceRegistry
    board: StepBoard
    store: ParameterStore
    servers: GatewayServer
    board_job: BoardJob
    """What boards are told when they register."""

    @property
    def port(self) -> int:
        return self.servers.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pairing_address(self) -> str:
        """Where boards pair (only with an authority)."""
        return f"127.0.0.1:{self.servers.pairing_port}"

    def open(self, assignments: dict[str, Assignment]) -> None:
        """Open a step attempt: each device gets its assignment on its next poll."""
        self.board.open_attempt(assignments)

    def wait(self, step: int, attempt: int = 0, timeout_s: float = 30.0) -> AttemptOutcome:
        """Block until every ticket of (step, attempt) is answered (or `timeout_s`), then close it."""
        return self.board.wait_attempt(step, attempt, time.monotonic() + timeout_s, self.registry.is_alive)

    def close(self) -> None:
        """Release every poll, then stop serving."""
        self.board.finish("coordinator stopped")
        self.servers.stop(grace=1.0)


def serve_coordinator(job: JobConfig, *, port: int = 0, authority: trust.Authority | None = None) -> InProcessCoordinator:
    """Serve `job` on 127.0.0.1:`port` (0: any free port) with version 0 of the parameters published:
    plaintext, or mutual TLS under `authority` (with its pairing port)."""
    model = build_model(job.model, seed=job.seed)
    registry = DeviceRegistry()
    board = StepBoard(UpdateFormats(shard_tensor_names(model)), model.block_names)
    store = ParameterStore(job.compression.downlink)
    store.publish(0, state_tensors(model))
    told = board_job(job, Aggregator(job, model, registry))
    servicer = CoordinatorServicer(job, told, registry, board, store)
    servers = serve_gateway(f"127.0.0.1:{port}", coordinator_service(servicer), authority=authority)
    return InProcessCoordinator(job, model, registry, board, store, servers, told)


def assignment(step: int = 0, attempt: int = 0, indices: Sequence[int] = SAMPLES, **fields) -> Assignment:
    """A data-parallel assignment on parameter version `step`."""
    return Assignment(step=step, attempt=attempt, param_version=step, indices=tuple(indices), augment=False,
                      data_seed=0, **fields)


