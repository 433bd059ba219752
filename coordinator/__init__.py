"""The gateway role: admits boards and drives training.

- ``servicer.py``   the Coordinator gRPC service (thin handlers -> status codes) and server factory.
- ``registry.py``   admitted devices: profile, speed estimate, liveness, telemetry window.
- ``discovery.py``  mDNS advertiser (``_edgetrain._tcp.local.``).
- ``steps.py``      the step board shared by handlers and driver: tickets, uploads, contributions.
- ``trainer.py``    the training driver: data parallel, federated rounds, pipelines (split, wait,
                    redo, update).
- ``aggregate.py``  screening (clip, outliers), sample- and staleness-weighted combination, the
                    optimizer step.
- ``codec_policy.py`` each board's link codec, fixed or adaptive from measured bandwidth.
- ``parameters.py`` what boards download: full versions, compressed deltas, a stage's part.
- ``pipeline_plan.py`` a pipeline plan as one step's assignments; merging a pipeline's results.
- ``stage_owners.py`` stages whose host owns their state: handing it over, pulling it back.
- ``planner.py``    cost model and plan search (DP over stages x board groups, Pareto).
- ``plan_inputs.py`` the planner's inputs: measured per-block model costs, boards from the
                    registry or a fleet file.
- ``live_planner.py`` hybrid mode: when to plan again and whether to switch (hysteresis).
- ``plan_command.py`` `edgetrain plan FLEET.yaml`.
- ``job_scheduler.py``, ``job_sim.py`` several jobs on one fleet: the rolling-horizon scheduler,
                    its baselines and a discrete-event simulator (not yet driving live jobs).
- ``metrics.py``, ``report.py``, ``checkpoint.py``  JSONL metrics, the summary, checkpoints.
- ``main.py``       entry point: build everything, serve, train, clean up.
"""
