"""The planner's front door: ``plan(profile, request)`` hands the :class:`PlanRequest` to
the pipeline search (:func:`autopipe.planner.search.plan_pipeline`) or, for a request with
tensor parallelism, data parallelism or sharded state, to the device-mesh search
(:func:`autopipe.planner.mesh.plan_mesh`), which itself runs the pipeline search per mesh."""

from __future__ import annotations

import warnings

from autopipe.planner.errors import PlanningError
from autopipe.planner.mesh import plan_mesh
from autopipe.planner.search import plan_pipeline
from autopipe.planner.trainer import trainer_profile

from autopipe.core.plan import Plan
from autopipe.core.profile import Profile
from autopipe.core.request import PlanRequest

__all__ = ["compile_mismatch", "plan"]


def compile_mismatch(profile: Profile, compile: bool) -> str | None:
    """What to warn, in one line, when a plan's ``compile`` (its stages ``torch.compile``'d)
    and how the profile's units were timed disagree, else ``None``: compiled stages planned on
    units timed eagerly or counted (their element-wise ops unfused, so priced slower than they
    run compiled), or a profile timed compiled planned for eager stages (which may pick a
    split-backward schedule, where torch runs no compiled stage). :func:`plan` warns it, and
    ``autopipe plan --compile`` prints it as it prints every warning."""
    measurement = profile.measurement
    timed_compiled = measurement is not None and measurement.compile
    name = profile.model or "the profile"
    if compile and not timed_compiled:
        how = "timed eagerly" if profile.mode == "measured" else "counted"
        return (
            f"compile: {name}'s units were {how} (element-wise ops unfused), so the plan "
            "prices them slower than compiled stages run; profile the model compiled on a "
            "local device (autopipe profile --compile, MeasureOptions(compile=True)) to time "
            "them compiled"
        )
    if timed_compiled and not compile:
        return (
            f"{name} was timed compiled but the plan is not: plan compiled stages (autopipe "
            "plan --compile, PlanRequest(compile=True)); torch runs none in the "
            "split-backward schedules"
        )
    return None


def plan(profile: Profile, request: PlanRequest) -> Plan:
    """Plan a K-stage pipeline for ``profile``; raises ``PlanningError`` if nothing fits.

    ``request`` says what to plan for (:class:`autopipe.core.request.PlanRequest`, e.g.
    ``PlanRequest(gpus=4, microbatches=8)``; to change one thing of an earlier plan,
    ``dataclasses.replace(old.request, microbatches=8)``). The request's fields: ``gpus=K``
    (K equal devices named after the profile's device, ``memory_per_device`` bytes each,
    ``None`` = unlimited) or ``cluster`` (devices in pipeline order); ``microbatches``: an
    integer, a tuple of candidates, or ``"auto"`` (every divisor of the batch size);
    ``schedule``: one of ``PLAN_SCHEDULES`` (``gpipe``, ``1f1b``, ``interleaved-1f1b``,
    ``looped-bfs``, ``interleaved-zb``, ``zbv``, ``dualpipev``) or ``"auto"`` (the fastest
    feasible schedule, V and M); ``virtual_stages``: V chunks per rank or ``"auto"``;
    ``compile``: the stages will be ``torch.compile``'d (no split-backward schedule); a request
    torch would refuse raises ``RuleViolation``; ``checkpoint``: ``"never"``, ``"always"``,
    ``"except_last"`` or ``"auto"`` (per stage, only where the activations would not fit);
    ``strategy``: ``"dp"`` (exact), ``"ilp"`` (exact, CBC, ``time_limit_s`` per solve),
    ``"brute-force"``, or a baseline ``"uniform"``, ``"parameters"``, ``"greedy-time"``.
    Memory per parameter: ``bytes_per_parameter`` or from ``optimizer`` (``auto``, ``sgd``,
    ``sgd-momentum``, ``adam``, ``adamw``, ``mixed-adam``, ``none``; see
    :func:`training_state`). ``headroom`` is the share of device memory kept free.
    ``tensor_parallel``, ``data_parallel``, ``shard`` (any of them not 1, 1, ``"none"``):
    plan the whole device mesh instead, ``gpus`` = N = PP x D x T devices
    (:func:`autopipe.planner.mesh.plan_mesh`; ``gpus_per_node``,
    ``inter_node_bandwidth_bytes_per_s`` give the nodes and their links).
    The plan records the request (``Plan.request``), the training state it charged
    (``Plan.optimizer``, ``Plan.state_bytes_per_parameter``) and the profile's unit
    granularity (``Plan.granularity``).
    """
    if not isinstance(request, PlanRequest):
        raise TypeError(
            f"plan() takes a PlanRequest, not {type(request).__name__}: "
            "plan(profile, PlanRequest(gpus=4, microbatches=8))"
        )
    if not profile.units:
        raise PlanningError("the profile has no units; profile a model with at least one module")
    mismatch = compile_mismatch(profile, request.compile)
    if mismatch is not None:
        warnings.warn(mismatch, stacklevel=2)
    profile = trainer_profile(profile, request)  # FP8, selective re-computation
    if request.plans_mesh:
        return plan_mesh(profile, request)
    return plan_pipeline(profile, request)
