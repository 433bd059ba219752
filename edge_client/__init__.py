"""The board role: joins a coordinator and computes what it is assigned.

- ``connection.py`` every RPC to the coordinator, retry on UNAVAILABLE, resumable transfers.
- ``profiler.py``   join-time profile: training speed at the job's batch sizes, memory.
- ``worker.py``     the data-parallel shard runtime (register, profile, heartbeat, work loop).
- ``main.py``       entry point: CPU limit, connect, work, clean up.
"""
