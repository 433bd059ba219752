"""Planning: which boards host which blocks as pipeline stages, and which join as DP shards.

- ``planner.py``     ``plan_optimal``, ``pareto``: the exact search, or beams and a climb.
- ``cost.py``        the cost model (step time, energy, memory of a plan): ``predict``.
- ``search.py``      the DP over blocks with Pareto labels per state, exact or as a beam.
- ``climb.py``       the heuristic's hill climb over plan shapes.
- ``brute_force.py`` the optimum by enumerating tiny instances: the tests' oracle.
- ``inputs.py``      what the planner is given: per-block model costs, boards as ``BoardCost``.
- ``measure.py``     timing this machine (per-block model cost, one core's speed, CPU per byte).
- ``cache.py``       those measurements on disk, with what they were measured on.
- ``live.py``        hybrid mode: when to plan again and whether to switch (hysteresis).
- ``command.py``     ``edgetrain plan FLEET.yaml``: a fleet file's plan, explained.

The plan and cost-model types (``Plan``, ``BoardCost``, ``ModelCost``, ...) live in the core,
``edgetrain.plan``.
"""
