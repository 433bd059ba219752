"""Several jobs share one fleet: the job server, its scheduler and the user's commands.

- ``server.py``      the job server: lobby of boards, one coordinator process per running job,
                     stalls, restarts.
- ``servicer.py``    its gRPC face (service ``JobServer``, mutual TLS under the fleet authority) and
                     ``serve_jobs``, the entry point.
- ``processes.py``   its job coordinator processes: port files, adopting, stopping.
- ``submission.py``  what a submitted job must say (no empty or defaulted jobs).
- ``lobby.py``       lobby boards: their claimed speed against what their jobs measured.
- ``store.py``       jobs persisted in ``<state-dir>/jobs.json``.
- ``scheduler.py``   rolling-horizon scheduling (branch and bound, greedy) and the FIFO,
                     first-fit and static baselines, all pure.
- ``speed.py``       the scheduler's oracle: the hybrid planner's predicted speed of a job.
- ``command.py``     ``edgetrain submit | jobs | cancel``.
"""
