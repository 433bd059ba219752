"""The board role: joins a coordinator and computes what it is assigned.

- ``connection.py`` every RPC to the coordinator, retry on UNAVAILABLE, resumable transfers.
- ``discovery.py``  mDNS browser: find the coordinator (by cluster) with no address typed.
- ``profiler.py``   join-time profile: training speed at the job's batch sizes, memory.
- ``telemetry.py``  psutil readings, link meter and probe, telemetry samples.
- ``emulation.py``  an emulated board's link, battery and energy (from its board file).
- ``devices.py``    `edgetrain devices`: advertised coordinators and their boards.
- ``worker.py``     the board runtime (register, profile, heartbeat, work loop): DP shards,
                    federated rounds, pipeline stages; codecs with error feedback, deltas.
- ``stage.py``      pipeline stages: the StagePeer endpoint, mailbox, and one step's schedule.
- ``stage_state.py`` the stage a board owns: parameters, buffers, SGD applied on commit.
- ``main.py``       entry point: CPU limit, connect, work, clean up.
"""
