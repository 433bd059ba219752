"""The emulated fleet: boards on one machine, so anyone can try EdgeTrain without boards.

A layer above the roles: it starts them as processes (``python -m edgetrain ...``) and, inside an
emulated board's process, hands the board role its emulated hardware; no role imports it. What a
fleet is (fleet and board files) is core: edgetrain.fleet_file.

- ``board.py``        an emulated board's throttle, memory cap, link and battery, installed in
                      its own client process (``edgetrain client --emulate | --speed``).
- ``fleet.py``        ``edgetrain fleet up | down``: the supervisor, its state and clean-up.
- ``netns.py``        a virtual LAN of network namespaces on a bridge with tc tbf links (root).
- ``throttle.py``     a board's CPU speed: cgroup v1 quota as root, duty-cycle throttle otherwise.
- ``shaping.py``      application-level link emulation (rate, delay, loss).
- ``battery.py``      an emulated battery draining with work.
- ``launch.py``       local runs: a coordinator and emulated boards as processes (``edgetrain local``).
- ``fleet_load.py``   load on one coordinator: hundreds of light boards' heartbeat round trips.
- ``light_boards.py`` many light fake boards in one process (real calls, synthetic profile and
                      telemetry) for the load benchmark.
- ``job_simulator.py`` a discrete-event simulator of a job scheduler on a job trace.
"""
