"""Several jobs share one fleet: the job server, its scheduler and the user's commands.

- ``server.py``      the job server: lobby of boards and the scheduling loop; reaps, restarts
                     stalled jobs, adopts coordinators after a restart (``edgetrain.supervisor``).
- ``launcher.py``    starts a job's own coordinator process.
- ``runfiles.py``    what a job's coordinator wrote: steps, progress, summary, dashboard URL.
- ``claims.py``      boards' claimed speeds checked against their single-board jobs.
- ``servicer.py``    its gRPC face (service ``JobServer``, mutual TLS under the fleet authority) and
                     ``serve_jobs``, the entry point.
- ``submission.py``  what a submitted job must say (no empty or defaulted jobs).
- ``lobby.py``       lobby boards: their claimed speed against what their jobs measured.
- ``store.py``       jobs persisted in ``<state-dir>/jobs.json``.
- ``scheduler.py``   rolling-horizon scheduling (branch and bound, greedy) and the FIFO,
                     first-fit and static baselines, all pure.
- ``speed.py``       the scheduler's oracle: the hybrid planner's predicted speed of a job.
- ``command.py``     ``edgetrain submit | jobs | cancel``.
"""
