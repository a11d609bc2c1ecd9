"""What a plan's device mesh must be for any rank to run it, read from the plan alone (no
model, no torch): the one statement of these rules, which ``autopipe run`` (every rank,
before building anything: ``autopipe.training`` and the mesh runtime's ``check_mesh_plan``),
``autopipe emit`` and the ``explain`` / ``plot`` pre-flight apply. A hand-edited plan
(``tensor_parallel`` 3 for a model with 4 heads, or ``10**30``) is refused by each alike.

Each problem is one line starting with the rule's name:

- ``mesh-degrees``: ``num_stages``, ``replicas`` and ``tensor_parallel`` are whole numbers
  of at least 1, and ``shard`` one of :data:`SHARD_MODES`.
- ``mesh-devices``: the mesh ``pp x dp x tp`` is the plan's devices (its mesh report's N).
- ``tp-plan``: T > 1 needs the plan's ``tp_plan`` (which modules TP splits).
- ``tp-degree``: T divides the model's split dimensions (heads, key/value heads: the T the
  embedded profile lists as ``tp_degrees``) and the GPUs of one node (a TP group never spans
  nodes).
"""

from __future__ import annotations

from autopipe.core.plan import Plan
from autopipe.core.vocabulary import SHARD_MODES

__all__ = ["MESH_RULES", "mesh_problems"]

MESH_RULES = ("mesh-degrees", "mesh-devices", "tp-plan", "tp-degree")


def _degree_problems(plan: Plan) -> list[str]:
    out = []
    for name in ("num_stages", "replicas", "tensor_parallel"):
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
    node = plan.mesh.gpus_per_node if plan.mesh is not None else None
    if node is not None and node % t:
        out.append(
            f"tp-degree: tensor_parallel {t} does not divide the {node} GPUs per node (a TP "
            "group never spans nodes)"
        )
    return out
