"""The planner's front door: ``plan(profile, request)`` hands the :class:`PlanRequest` to
the pipeline search (:func:`autopipe.planner.search.plan_pipeline`) or, for a request with
tensor parallelism, data parallelism or sharded state, to the device-mesh search
(:func:`autopipe.planner.mesh.plan_mesh`), which itself runs the pipeline search per mesh."""

from __future__ import annotations

from autopipe.planner.errors import PlanningError
from autopipe.planner.mesh import plan_mesh
from autopipe.planner.search import plan_pipeline
from autopipe.planner.trainer import trainer_profile

from autopipe.core.plan import Plan
from autopipe.core.profile import Profile
from autopipe.core.request import PlanRequest

__all__ = ["plan"]


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
    profile = trainer_profile(profile, request)  # FP8, selective re-computation
    if request.plans_mesh:
        return plan_mesh(profile, request)
    return plan_pipeline(profile, request)
