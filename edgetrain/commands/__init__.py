"""The `edgetrain` command's handlers, one module per group of commands; edgetrain/cli.py holds
the parser and dispatches to them. With cli.py they are the face above both roles: the only
modules of edgetrain/ that import coordinator/ or edge_client/, and only inside a handler, so
that `--help` and the commands that need no torch start without it.

roles.py      coordinator, client: serve a job (or a job server), run a board's part of it
operator.py   submit, jobs, cancel, devices, plan, dashboard: ask and steer a running fleet
emulated.py   local, demo, fleet, experiment, report: run on this machine, and report on runs
authority.py  init, token, boards, operator: the fleet authority's records
"""
