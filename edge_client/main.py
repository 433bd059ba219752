"""Edge client entry point: install the board's hardware seams (real ones, or the emulated ones
the layer above hands it), obtain the board's fleet credentials (pairing with a join token the
first time), find the coordinator, work, always clean up."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import edgetrain
from edge_client.connection import CALLS, CoordinatorConnection, CoordinatorUnreachable
from edge_client.credentials import BoardCredentials, obtain, trusted_calls
from edge_client.lobby import Lobby
from edge_client.local_data import LocalData
from edge_client.profiler import set_threads, torch_threads_for
from edge_client.telemetry import LinkMeter
from edge_client.worker import BATTERY_EMPTY, ClientOptions, EdgeWorker
from edgetrain import transport
from edgetrain.board_hardware import BoardHardware
from edgetrain.discovery import (
    CoordinatorNotFound,
    default_interfaces,
    find_coordinator,
    serves_jobs,
)
from edgetrain.training import exact_arithmetic, runtime

logger = logging.getLogger(__name__)

__all__ = ["BATTERY_EMPTY", "run_client"]


def _discover(cluster: str | None, interfaces: list[str] | None, ca_fingerprint: str, timeout_s: float = 30.0) -> str:
    """The address of the coordinator of the fleet whose CA is `ca_fingerprint` ("": an
    `--insecure` one, which advertises no CA)."""
    record = find_coordinator(interfaces=interfaces or default_interfaces(), cluster=cluster, timeout_s=timeout_s,
                              protocol_version=edgetrain.PROTOCOL_VERSION, ca_fingerprint=ca_fingerprint)
    logger.info("[Client] found coordinator %s (cluster %s) at %s over mDNS", record.instance, record.cluster,
                record.address)
    return record.address


def _credentials(address: str | None, options: ClientOptions, cluster: str | None,
                 interfaces: list[str] | None) -> BoardCredentials | None:
    """The board's fleet credentials (None with `--insecure`); see edge_client.credentials.obtain."""
    if options.insecure:
        return None
    return obtain(options.name, identity_path=options.identity, join_token=options.join_token, address=address,
                  pair_address=options.pair_address,
                  find_gateway=lambda fingerprint: _discover(cluster, interfaces, fingerprint))


class Outage:
    """The board's time without a coordinator: one log line when it begins and one when it ends,
    tries spaced by a backoff capped at a few seconds, and, with a budget, an end to trying."""

    def __init__(self, budget_s: float | None, *, retry: transport.RetryPolicy = CALLS,
                 clock=time.monotonic) -> None:
        self.budget_s = budget_s
        """Give up after this many seconds without reaching a coordinator (None: never)."""
        self._retry, self._clock = retry, clock
        self.since: float | None = None
        """When the coordinator was last lost (None: in touch)."""
        self._backoff: transport.Backoff | None = None

    def failed(self, error: BaseException, where: str) -> None:
        """A try to reach the coordinator failed: log the first one, wait before the next, or
        raise CoordinatorUnreachable when the budget is spent."""
        now = self._clock()
        if self.since is None:
            self.since = now
            self._backoff = replace(self._retry, budget_s=None).start("coordinator")
            logger.warning("[Client] lost the coordinator (%s); trying %s again %s", transport.describe(error),
                           where, "until it answers" if self.budget_s is None else f"for {self.budget_s:g} s")
        elif self.budget_s is not None and now - self.since > self.budget_s:
            raise CoordinatorUnreachable(f"no coordinator reached for {now - self.since:.0f} s "
                                         f"(--give-up-after {self.budget_s:g}): {transport.describe(error)}")
        self._backoff.wait(error)

    def reached(self, address: str) -> None:
        """A coordinator answered at `address`."""
        if self.since is not None:
            logger.info("[Client] coordinator reached at %s after %.1f s without one", address,
                        self._clock() - self.since)
        self.since, self._backoff = None, None


LOCATE_RETRY = transport.RetryPolicy(budget_s=5.0, max_s=1.0)
"""One try to reach a known address during an outage (the outage's own backoff spaces the tries)."""
LOOKUP_S = 5.0
"""One mDNS lookup during an outage."""


def _locate(address: str | None, last: str | None, browse: bool, cluster: str | None,
            interfaces: list[str] | None, fleet: str, security: transport.Security,
            credentials: BoardCredentials | None) -> tuple[str, bool]:
    """(address, whether it serves jobs) of a coordinator that answers: the given or last known
    address first, then (when `browse`) an mDNS lookup for the fleet's coordinator, which may have
    come back elsewhere. transport.Unreachable or CoordinatorNotFound when neither answers."""
    error: Exception | None = None
    for candidate in dict.fromkeys(a for a in (address, last) if a):
        try:
            with trusted_calls(credentials):
                return candidate, serves_jobs(candidate, security=security, retry=LOCATE_RETRY)
        except transport.Unreachable as e:
            error = e
    if not browse:
        raise error
    found = _discover(cluster, interfaces, fleet, timeout_s=LOOKUP_S if (address or last) else 30.0)
    with trusted_calls(credentials):
        return found, serves_jobs(found, security=security, retry=LOCATE_RETRY)


def run_client(address: str | None, options: ClientOptions, *, hardware: BoardHardware | None = None,
               threads: int | None = None, cluster: str | None = None, interfaces: list[str] | None = None) -> str:
    """Work for the coordinator at `address` (found over mDNS when None) until its job ends; at
    a job server (`edgetrain coordinator --jobs`), serve one job after another.

    Unless `options.insecure`, every channel and the board's StagePeer endpoint use its fleet
    certificate (paired with `options.join_token` when there is none yet), mDNS finds only its
    own fleet's coordinators, and the certificate renews itself in the background. A certificate
    that expired or was revoked ends the client with a TrustError (one line, exit code 5 in the
    CLI) instead of retries.

    A coordinator (or job server) that goes away is tried again until it answers — for
    `options.give_up_after_s` at most, when set: the last address it answered at, and over mDNS
    (always when the board found it that way; with an explicit `address`, when `interfaces` are
    given), so one that came back on another address is found. The board then registers again
    with its own credentials and gets work. Returns the coordinator's reason for finishing, or
    BATTERY_EMPTY when an emulated battery ran flat.

    `hardware` is the machine the board computes on (edgetrain.board_hardware; None: this real
    board, its energy modelled from `options.power_w` when its battery cannot measure it); its
    throttle and memory cap are installed while the client runs.

    With `options.local_data` the board trains on its own images only, decoded once before it
    looks for a coordinator (edge_client.local_data: LocalDataError, one line, when they cannot be
    used, and when they are gone mid-job).
    """
    hardware = hardware or BoardHardware.real(options.power_w)
    local = LocalData(options.local_data, options.data_dir).prepare() if options.local_data else None
    set_threads(threads or torch_threads_for(options.emulated_speed))
    if options.deterministic:
        exact_arithmetic()
    logger.info("[Client] %s: %s%s", options.name, runtime(), ", TF32 off, deterministic kernels"
                if options.deterministic else "")
    link = LinkMeter()
    browse = address is None or bool(interfaces)
    where = " or ".join(filter(None, (address, "over mDNS" if browse else "")))
    with hardware.installed(options.name):
        credentials = _credentials(address, options, cluster, interfaces)
        fleet = credentials.ca_fingerprint if credentials else ""
        security = credentials.gateway() if credentials else transport.INSECURE
        outage = Outage(options.give_up_after_s)
        worker: EdgeWorker | None = None
        last: str | None = None
        try:
            while True:
                if credentials is not None:
                    credentials.check()
                try:
                    found, jobs = _locate(address, last, browse, cluster, interfaces, fleet, security, credentials)
                except (transport.Unreachable, CoordinatorNotFound) as e:
                    outage.failed(e, where or last)
                    continue
                outage.reached(found)
                last = found
                if credentials is not None:
                    credentials.gateway_address = found
                    credentials.start_renewal()
                try:
                    if jobs:
                        lobby = Lobby(found, options, hardware, link, credentials, local=local)
                        try:
                            return lobby.serve()
                        finally:
                            lobby.close()
                    conn = CoordinatorConnection(found, shaper=hardware.shaper, link=link, credentials=credentials)
                    if worker is None:
                        worker = EdgeWorker(conn, options, hardware, local)
                    worker.conn = conn
                    try:
                        return worker.run()
                    finally:
                        conn.close()
                except CoordinatorUnreachable as e:
                    outage.failed(e, where or found)
        finally:
            if credentials is not None:
                credentials.stop()
            if worker is not None and worker.endpoint is not None:
                worker.endpoint.close()
