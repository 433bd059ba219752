"""The board role: joins a coordinator (or a job server's lobby) and computes what it is assigned.

- ``main.py``       entry point: install the board's hardware seams (edgetrain.board_hardware),
                    find the coordinator, work, always clean up.
- ``connection.py`` every RPC to the coordinator, over edgetrain.transport (retries, resumable
                    transfers).
- ``worker.py``     the board runtime (register, profile, heartbeat, work loop): DP shards,
                    federated rounds, pipeline stages; codecs with error feedback, deltas.
- ``stage.py``      running this board's pipeline stage for one step: ``StageExecutor`` runs the
                    schedule's forward and backward ops and the exchanges with neighbouring stages.
- ``stage_exchange.py`` a stage's sends to its peers in one step, a channel group's exchange.
- ``endpoint.py``   the StagePeer endpoint every board serves: mailbox, state hand-over and pull.
- ``stage_state.py`` the stage a board owns: parameters, buffers, SGD applied on commit.
- ``lobby.py``      a board in a job server's lobby: wait for a job, work for it, come back.
- ``profiler.py``   join-time profile: training speed at the job's batch sizes, memory.
- ``telemetry.py``  psutil readings, link meter and probe, telemetry samples.

The board knows no emulator: an emulated board's throttle, link shaping and battery are handed to
it by edgetrain.emulator.board.
"""
