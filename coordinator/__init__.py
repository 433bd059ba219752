"""The gateway role: admits boards and drives training.

- ``servicer.py``   the Coordinator gRPC service (thin handlers -> status codes) and server factory.
- ``registry.py``   admitted devices: profile, speed estimate, liveness, telemetry window.
- ``discovery.py``  mDNS advertiser (``_edgetrain._tcp.local.``).
- ``steps.py``      the step board shared by handlers and driver: work, uploads, contributions.
- ``trainer.py``    the synchronous data-parallel driver (split, wait, redo, update).
- ``aggregate.py``  sample-weighted combination and the optimizer step.
- ``metrics.py``, ``report.py``, ``checkpoint.py``  JSONL metrics, the summary, checkpoints.
- ``main.py``       entry point: build everything, serve, train, clean up.
"""
