"""autopipe.core: the plain data every layer shares. Torch-free, and imports nothing else
from autopipe.

- ``profile``: the Profile (what each unit of a model costs) and its JSON;
- ``plan``: the Plan (what every rank executes: stages, schedule, mesh) and its JSON;
  ``plan_report``: its PlanReport (the predictions, baselines, candidates, notes);
- ``plan_records``, ``profile_records``: the typed records they keep (the mesh report, the
  candidates weighed, how a profile was measured); ``meta_fields``: the one reader moving
  earlier files' ``meta`` keys into those fields;
- ``request``: the PlanRequest (what to plan for);
- ``cluster``, ``catalog``: devices, links and the datasheet catalog;
- ``schedule_rules``: where each chunk of a schedule runs and the rules torch enforces for
  it, which the planner and every rank of the runtime check; ``checkpointing``: a
  re-materialization mode as per-stage flags;
- ``timeline``: the one Timeline of what runs where and when (simulated or recorded);
- ``vocabulary``: the names of schedules, checkpoint modes and torch's schedule classes;
- ``optimizer``: training-state bytes per parameter by optimizer;
- ``fields``, ``datafile``: checks of loaded values, versioned atomic JSON files;
- ``humanize``: quantities for humans (bytes, seconds);
- ``errors``: ``AutopipeError``, with ``UsageError`` (bad input, exit 2) and ``Failure``
  (the work failed, exit 1) under it.

The profiler and the runtime import it, the planner imports only it (and itself).
"""
