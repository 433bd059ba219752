"""Edge client entry point: limit CPU as emulated, connect, work, always clean up."""

from __future__ import annotations

import logging

from edge_client.connection import CoordinatorConnection
from edge_client.profiler import set_threads, torch_threads_for
from edge_client.worker import ClientOptions, DataParallelWorker
from edgetrain.throttle import limit_cpu

logger = logging.getLogger(__name__)


def run_client(address: str, options: ClientOptions, *, threads: int | None = None) -> str:
    """Join the coordinator at `address` and work until its job finishes; returns the reason."""
    set_threads(threads or torch_threads_for(options.emulated_speed))
    with limit_cpu(options.emulated_speed, name=options.name) as limiter:
        if options.emulated_speed:
            logger.info("[Client] %s emulates %.2f of a core (%s)", options.name, options.emulated_speed,
                        limiter.mode)
        conn = CoordinatorConnection(address)
        try:
            return DataParallelWorker(conn, options, limiter).run()
        finally:
            conn.close()
