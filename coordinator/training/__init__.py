"""Training: the step loop and everything one job's steps are made of.

- ``trainer.py``       the step loop: publish, attempts, aggregate, evaluate, checkpoint.
- ``rounds.py``        round policies: what each board does in an attempt, when it counts;
                       ``make_round_policy`` picks the job's.
- ``data_parallel.py`` data-parallel rounds (sync, deadline/staleness) and federated rounds.
- ``pipeline_round.py`` pipeline rounds: the plan in force as stages, DP shards and boards beside them.
- ``plan_sources.py`` where that plan comes from: a hand plan, a plan file, or the live planner
  (measured trials before it commits).
- ``pipeline_work.py`` a plan turned into one step's pipeline work; a pipeline's results merged.
- ``aggregator.py``    the aggregation rule: screening, weights, late updates, the server optimizer.
- ``steps.py``         the step board shared with the RPC handlers: tickets, uploads, outcomes.
- ``parameters.py``    what boards download: full versions, compressed deltas, a stage's part.
- ``codec_policy.py``  each board's link codec, fixed or adaptive from measured bandwidth.
- ``stage_owners.py``  stages whose host owns their state: handing it over, pulling it back.
- ``metrics.py``, ``report.py``, ``checkpoint.py``  JSONL metrics, the summary, checkpoints.
"""
