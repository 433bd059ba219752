"""The gateway role: admits boards, plans the training and drives it; or serves several jobs.

- ``main.py``        entry point: build the job, serve, train, report, always clean up.
- ``servicer.py``    the Coordinator gRPC service: thin handlers, exceptions -> status codes; a
                     board acts only under its certificate's name.
- ``pairing.py``     the Pairing service (join tokens, renewal), the access rules of gateway
                     servers, and ``serve_gateway`` (fleet port + pairing port).
- ``registry.py``    admitted devices: profile, speed estimate, liveness, telemetry window.
- ``advertiser.py``  mDNS advertisement (``_edgetrain._tcp.local.``).
- ``devices.py``     ``edgetrain devices``: advertised coordinators and their boards.
- ``training/``      the step loop, round policies, aggregation, step board, parameters, stage
                     state held by boards, metrics, checkpoints.
- ``planning/``      the hybrid planner, its inputs, live re-planning, ``edgetrain plan``.
- ``jobs/``          the job server: several jobs share one fleet.
- ``dashboard/``     the live dashboard and Prometheus ``/metrics``: ``server.py`` (HTTP, token,
                     TLS), ``view.py`` (the run as one snapshot), ``prometheus.py``, ``static/``.
"""
