"""What a plan's device mesh must be for any rank to run it, read from the plan alone (no
model, no torch): the one statement of these rules, which ``autopipe run`` (every rank,
before building anything: ``autopipe.training`` and the mesh runtime's ``check_mesh_plan``),
``autopipe emit`` and the ``explain`` / ``plot`` pre-flight apply. A hand-edited plan
(``tensor_parallel`` 3 for a model with 4 heads, or ``10**30``) is refused by each alike.

Each problem is one line starting with the rule's name:

- ``mesh-degrees``: ``num_stages``, ``data_parallel`` and ``tensor_parallel`` are whole numbers
  of at least 1, and ``shard`` one of :data:`SHARD_MODES`.
- ``mesh-devices``: the mesh ``pp x dp x tp`` is the plan's devices (its mesh report's N).
- ``tp-plan``: T > 1 needs the plan's ``tp_plan`` (which modules TP splits).
- ``tp-degree``: T divides the model's split dimensions (heads, key/value heads: the T the
  embedded profile lists as ``tp_degrees``) and the GPUs of one node (a TP group never spans
  nodes).
- ``tp-runs``: T > 1 needs a model whose TP stages the runtime can trace and run sequence
  parallel (the embedded profile's ``tp_refusal``, found when profiling, is None).
- ``tied-chunks``: a parameter tied across chunks (an embedding and its LM head on two
  stages) runs only without FSDP-sharded state (shard ``parameters``, ``gradients``)
  (:func:`tied_chunks_problem`: the one statement of the rule, which the planner's search
  and the mesh runtime's ``check_mesh_plan`` both apply).

One more rule is ``autopipe run``'s alone, not the plan's (``emit`` hands such a plan to
frameworks that run it, so :func:`mesh_problems` leaves it out):

- ``mesh-schedule``: on the mesh runtime (:func:`uses_mesh`) no schedule that splits the
  backward (:data:`SPLIT_BACKWARD_SCHEDULES`) runs (:func:`mesh_schedules`,
  :func:`mesh_schedule_problem`: the one statement, which the mesh runtime's
  ``check_mesh_plan`` and the planner's mesh search both apply, so no plan names one).
- ``loss-parallel``: a plan priced with loss parallelism (``Plan.trainer.loss_parallel``,
  from ``PlanRequest.loss_parallel``, and T > 1: the logits sharded over TP, cross-entropy on the shards, as torchtitan and Megatron
  run it) is not what the runtime runs (it gathers an LM head's logits to every TP rank):
  :func:`loss_parallel_problem`, which ``check_mesh_plan`` applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from autopipe.core.plan import Plan
from autopipe.core.profile import UnitProfile
from autopipe.core.vocabulary import PLAN_SCHEDULES, SHARD_MODES, SPLIT_BACKWARD_SCHEDULES

__all__ = [
    "MESH_RULES",
    "MeshDegrees",
    "loss_parallel_problem",
    "mesh_problems",
    "mesh_schedule_problem",
    "mesh_schedules",
    "tied_chunks",
    "tied_chunks_problem",
    "tied_chunks_problems",
    "uses_mesh",
]

MESH_RULES = ("mesh-degrees", "mesh-devices", "tp-plan", "tp-degree", "tp-runs", "tied-chunks")


class MeshDegrees(Protocol):
    """A mesh's degrees, as a :class:`Plan` holds them (and the planner's mesh candidates)."""

    @property
    def tensor_parallel(self) -> int: ...
    @property
    def shard(self) -> str: ...
    @property
    def context_parallel(self) -> int: ...
    @property
    def expert_parallel(self) -> int: ...


def uses_mesh(plan: MeshDegrees) -> bool:
    """Whether ``plan`` runs on the (pp, dp, cp, tp) mesh (T > 1, sharded state, context or
    expert parallelism); plans with T = 1, ``shard = none``, C = 1 and E = 1 keep the plain
    K x D path."""
    return (
        plan.tensor_parallel > 1
        or plan.shard != "none"
        or plan.expert_parallel > 1
        or plan.context_parallel > 1
    )


def mesh_schedules(mesh: MeshDegrees) -> tuple[str, ...]:
    """The schedules ``autopipe run`` runs on ``mesh`` (``PLAN_SCHEDULES`` order): all of
    them on the plain K x D path, on the mesh runtime (:func:`uses_mesh`) none that splits
    the backward into input and weight passes (its weight pass is not combined with TP,
    FSDP's deferred reduction, the context-parallel ring or the expert all-to-all)."""
    if not uses_mesh(mesh):
        return PLAN_SCHEDULES
    return tuple(s for s in PLAN_SCHEDULES if s not in SPLIT_BACKWARD_SCHEDULES)


def mesh_schedule_problem(mesh: MeshDegrees, schedule: str) -> str | None:
    """The ``mesh-schedule`` rule: the one-line refusal of ``schedule`` on ``mesh``, naming
    the schedules that run there, or None (also for a name that is no schedule, which the
    schedule rules refuse)."""
    runs = mesh_schedules(mesh)
    if schedule in runs or schedule not in PLAN_SCHEDULES:
        return None
    return (
        f"mesh-schedule: {schedule} splits the weight pass, which autopipe run does not "
        "combine with TP, sharded state, context or expert parallelism; use --schedule auto "
        f"or one it runs on this mesh: {', '.join(runs)}"
    )


def loss_parallel_problem(plan: Plan) -> str | None:
    """The ``loss-parallel`` rule: the one-line refusal of a plan priced with loss
    parallelism (``plan.trainer.loss_parallel``) on a TP mesh (its head priced with sharded
    logits and no logits all-gather), which ``autopipe run`` does not run (its LM head
    gathers the logits, ``colwise_gather_output``); None otherwise (T = 1: nothing is
    gathered)."""
    if not plan.trainer.loss_parallel or plan.tensor_parallel <= 1:
        return None
    return (
        "loss-parallel: the plan was priced with the logits sharded over the "
        f"{plan.tensor_parallel} TP ranks (--loss-parallel, as torchtitan and Megatron run "
        "the loss), but autopipe run gathers them to every TP rank; re-plan without "
        "--loss-parallel, or emit it for torchtitan or Megatron"
    )


TIED_CHUNKS_SHARDS = ("none", "optimizer")
"""The shard modes under which the runtime keeps a parameter tied across chunks right."""


def tied_chunks_problem(
    name: str, chunks: Sequence[int], tensor_parallel: int, shard: str
) -> str | None:
    """The ``tied-chunks`` rule for one parameter ``name`` used by the chunks ``chunks``
    (stage indexes) of a plan with ``tensor_parallel`` and ``shard``: the one-line refusal,
    or None. The runtime keeps a tied parameter's copies on several chunks equal by summing
    their gradients over the ranks holding them, after the backward and before the
    optimizer: plain copies, TP-split ones (any T: a DTensor placed alike on every holder,
    whose local shards are summed) and, under ZeRO-1 (``optimizer``), copies whose owners
    step the same summed gradient. Not FSDP-sharded ones (``parameters``, ``gradients``):
    FSDP2 manages one chunk's parameters as its own group, which a parameter two chunks of
    one rank share would be twice. ``tensor_parallel`` is kept for the callers' one
    signature. O(chunks)."""
    del tensor_parallel
    if len(set(chunks)) <= 1 or shard in TIED_CHUNKS_SHARDS:
        return None
    return (
        f"tied-chunks: parameter {name!r} is tied across chunks {sorted(set(chunks))}; "
        f"autopipe run keeps tied copies equal only with shard {' or '.join(TIED_CHUNKS_SHARDS)}"
        f" (FSDP's shard {shard} groups each chunk's parameters apart): untie it, or re-plan "
        "with --shard optimizer or none"
    )


def tied_chunks(
    units: Sequence[UnitProfile], stages: Sequence[Sequence[str]]
) -> dict[str, list[int]]:
    """``{parameter: [chunk, ...]}`` for every parameter the profile's ``units`` share
    (``UnitProfile.shared_parameters``) that units of more than one of ``stages`` (each a
    chunk's unit names, in chunk order) use. O(units x their shared parameters)."""
    chunk_of = {name: c for c, names in enumerate(stages) for name in names}
    used: dict[str, set[int]] = {}
    for unit in units:
        c = chunk_of.get(unit.name)
        if c is None:
            continue
        for parameter in unit.shared_parameters:
            used.setdefault(parameter, set()).add(c)
    return {p: sorted(cs) for p, cs in used.items() if len(cs) > 1}


def tied_chunks_problems(
    units: Sequence[UnitProfile],
    stages: Sequence[Sequence[str]],
    tensor_parallel: int,
    shard: str,
) -> list[str]:
    """:func:`tied_chunks_problem` for every parameter tied across ``stages``."""
    out = []
    for name, chunks in tied_chunks(units, stages).items():
        problem = tied_chunks_problem(name, chunks, tensor_parallel, shard)
        if problem is not None:
            out.append(problem)
    return out


def _degree_problems(plan: Plan) -> list[str]:
    out = []
    for name in ("num_stages", "data_parallel", "tensor_parallel"):
        value = getattr(plan, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            out.append(f"mesh-degrees: {name}={value!r} must be a whole number of at least 1")
    if plan.shard not in SHARD_MODES:
        out.append(f"mesh-degrees: shard={plan.shard!r}; use one of {', '.join(SHARD_MODES)}")
    return out


def mesh_problems(plan: Plan) -> list[str]:
    """Every mesh rule ``plan`` breaks, one line each ([]: the mesh is one a rank can build).
    O(1) in the degrees' sizes (no enumeration up to T)."""
    out = _degree_problems(plan)
    if out:
        return out
    out += _tp_problems(plan)
    if plan.profile is not None:
        out += tied_chunks_problems(
            plan.profile.units, [s.units for s in plan.stages], plan.tensor_parallel, plan.shard
        )
    if plan.mesh is not None and plan.world_size != plan.mesh.gpus:
        pp, dp, tp = plan.mesh_shape
        out.append(
            f"mesh-devices: the mesh pp {pp} x dp {dp} x tp {tp} is {plan.world_size} "
            f"devices but the plan was made for {plan.mesh.gpus}; re-plan rather than edit "
            "the degrees"
        )
    return out


def _tp_problems(plan: Plan) -> list[str]:
    """The ``tp-plan`` and ``tp-degree`` rules."""
    t = plan.tensor_parallel
    out: list[str] = []
    if t == 1:
        return out
    if not plan.tp_plan:
        out.append(
            f"tp-plan: the plan has tensor_parallel {t} but no tp_plan; re-plan with a model "
            "that has a TP plan, or with --tensor-parallel 1"
        )
    allowed = plan.profile.tp_degrees if plan.profile is not None else None
    if allowed is not None and t not in allowed:
        ok = ", ".join(map(str, allowed)) or "none"
        out.append(
            f"tp-degree: tensor_parallel {t} does not divide the model's split dimensions "
            f"(heads, key/value heads); T > 1 it allows: {ok}"
        )
    refusal = plan.profile.tp_refusal if plan.profile is not None else None
    if refusal:
        out.append(f"tp-runs: tensor_parallel {t} cannot run for this model: {refusal}")
    node = plan.mesh.gpus_per_node if plan.mesh is not None else None
    if node is not None and node % t:
        out.append(
            f"tp-degree: tensor_parallel {t} does not divide the {node} GPUs per node (a TP "
            "group never spans nodes)"
        )
    return out
