"""The board role: joins a coordinator and computes what it is assigned.

- ``connection.py`` every RPC to the coordinator, retry on UNAVAILABLE, resumable transfers.
- ``discovery.py``  mDNS browser: find the coordinator (by cluster) with no address typed.
- ``profiler.py``   join-time profile: training speed at the job's batch sizes, memory.
- ``telemetry.py``  psutil readings, link meter and probe, telemetry samples.
- ``emulation.py``  an emulated board's link, battery and energy (from its board file).
- ``devices.py``    `edgetrain devices`: advertised coordinators and their boards.
- ``worker.py``     the data-parallel shard runtime (register, profile, heartbeat, work loop).
- ``main.py``       entry point: CPU limit, connect, work, clean up.
"""
