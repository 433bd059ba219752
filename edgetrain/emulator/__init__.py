"""The emulated fleet: boards on one machine, so anyone can try EdgeTrain without boards.

It starts the roles as processes (``python -m edgetrain ...``), never imports them.

- ``fleet_config.py`` fleet and board files (speed, link, battery, scripted events).
- ``fleet.py``        ``edgetrain fleet up | down``: the supervisor, its state and clean-up.
- ``netns.py``        a virtual LAN of network namespaces on a bridge with tc tbf links (root).
- ``throttle.py``     a board's CPU speed: cgroup v1 quota as root, duty-cycle throttle otherwise.
- ``shaping.py``      application-level link emulation (rate, delay, loss).
- ``battery.py``      an emulated battery draining with work; the real battery through psutil.
- ``launch.py``       local runs: a coordinator and emulated boards as processes (``edgetrain local``).
- ``fleet_load.py``   load on one coordinator: hundreds of light boards' heartbeat round trips.
"""
