"""autopipe: automatic GPipe-style pipeline parallelism for PyTorch.

``profile`` (model + ``MeasureOptions`` -> Profile), ``plan`` (Profile + PlanRequest -> Plan),
``parallelize`` and ``GPipe`` (model + Plan -> running pipeline). What ``autopipe plan
MODEL.py`` does, step by step: ``resolve_devices`` (the ``--device`` / ``--device-spec``
flags, once), ``profile_model_file`` (a ``MODEL.py[:FACTORY]`` file, as a ``ProfileRequest``
says), ``plan_on_devices`` (a ``Placement``: the request on those devices, replicated or as a
mesh), ``emit`` (the plan in another framework's words). What ``autopipe run`` does on every
rank that torchrun starts: ``train`` (a ``TrainRequest``). Names are resolved lazily so that
``import autopipe.planner`` never pulls in torch.
"""

from __future__ import annotations

from autopipe.core.lazy import lazy_attributes

__version__ = "0.2.0"
"""The one version of the package (pyproject.toml reads it from here; CHANGELOG.md)."""

_LAZY = {
    "profile": ("autopipe.profiling", "profile"),
    "MeasureOptions": ("autopipe.profiler.options", "MeasureOptions"),
    "Profile": ("autopipe.core.profile", "Profile"),
    "UnitProfile": ("autopipe.core.profile", "UnitProfile"),
    "load_profile": ("autopipe.profiler", "load_profile"),
    "plan": ("autopipe.planner", "plan"),
    "PlanRequest": ("autopipe.core.request", "PlanRequest"),
    "resolve_devices": ("autopipe.device_target", "resolve_devices"),
    "cluster_for": ("autopipe.device_target", "cluster_for"),
    "profile_model_file": ("autopipe.profiling", "profile_model_file"),
    "ProfileRequest": ("autopipe.profiling", "ProfileRequest"),
    "Placement": ("autopipe.placement", "Placement"),
    "plan_on_devices": ("autopipe.placement", "plan_on_devices"),
    "scaling_rows": ("autopipe.placement", "scaling_rows"),
    "emit": ("autopipe.planner.emit", "emit"),
    "Plan": ("autopipe.core.plan", "Plan"),
    "StagePlan": ("autopipe.core.plan", "StagePlan"),
    "PlanReport": ("autopipe.core.plan_report", "PlanReport"),
    "StageReport": ("autopipe.core.plan_report", "StageReport"),
    "load_plan": ("autopipe.core.plan", "load_plan"),
    "Cluster": ("autopipe.core.cluster", "Cluster"),
    "Device": ("autopipe.core.cluster", "Device"),
    "PlanningError": ("autopipe.planner", "PlanningError"),
    "parallelize": ("autopipe.parallelizing", "parallelize"),
    "Pipeline": ("autopipe.runtime", "Pipeline"),
    "GPipe": ("autopipe.runtime", "GPipe"),
    "replay": ("autopipe.replay_report", "replay"),
    "train": ("autopipe.training", "train"),
    "TrainRequest": ("autopipe.training", "TrainRequest"),
    "bench_model_file": ("autopipe.benchmarking", "bench_model_file"),
    "BenchRequest": ("autopipe.benchmarking", "BenchRequest"),
    "plot_plan": ("autopipe.plotting", "plot_plan"),
    "PlotRequest": ("autopipe.plotting", "PlotRequest"),
}

__all__ = ["__version__", *_LAZY]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
