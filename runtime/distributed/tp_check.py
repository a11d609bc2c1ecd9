"""Whether the mesh runtime can run a model at T > 1, asked when profiling (issue 33: a plan
must never be refused after start-up on every rank).

:func:`tp_refusal` runs, once, on one process, the steps every rank of a T > 1 plan takes
before building anything (``DistributedPipeline._join_groups``): the model's split modules
(:func:`.mesh.planned_modules`), the re-trace at one TP rank's shapes
(:func:`.mesh.local_shapes`, :func:`autopipe.runtime.planned_stages.partition`), the
sequence-parallel layout of the traced graph (the runtime's own
:func:`.pipeline.planned_sequence_layout`) and
the parameters whose gradients TP leaves partial
(:func:`.tp_gradients.partial_gradient_parameters`). What stops them is the one-line reason
the profile records as ``Profile.tp_refusal``; the planner then plans T = 1 only. The plan
used is the whole model as one chunk: what is refused here does not depend on the cut.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from autopipe.profiler.inputs import batch_size_of
from autopipe.runtime.distributed.mesh import local_shapes, planned_modules
from autopipe.runtime.distributed.pipeline import planned_sequence_layout
from autopipe.runtime.distributed.tp_gradients import partial_gradient_parameters
from autopipe.runtime.planned_stages import partition
from torch import nn
from torch.utils._pytree import tree_map

from autopipe.core.errors import UsageError
from autopipe.core.plan import Plan, StagePlan
from autopipe.core.profile import Profile

__all__ = ["tp_refusal"]

log = logging.getLogger("autopipe")


def tp_refusal(model: nn.Module, example_inputs: Any, profile: Profile) -> str | None:
    """Why the mesh runtime cannot run ``model`` (profiled as ``profile``, on
    ``example_inputs``) at the smallest T > 1 of ``profile.tp_degrees``, in one line
    (``"<error class>: <its first line>"``, what every rank would print), or None when it
    can or the profile allows no T > 1. One trace of the model; nothing runs on a device."""
    if not profile.tp_plan or not profile.tp_degrees:
        return None
    t = min(profile.tp_degrees)
    rows = batch_size_of(example_inputs)
    plan = Plan(
        num_stages=1,
        microbatches=1,
        microbatch_size=rows,
        batch_size=rows,
        stages=[StagePlan(index=0, device="cpu", units=profile.unit_names)],
        granularity=profile.granularity,
        tensor_parallel=t,
        tp_plan=dict(profile.tp_plan),
    )
    if any(p.is_meta for p in model.parameters()):
        # counted on meta (analytic profiles): trace on meta inputs too, as the counting did
        example_inputs = tree_map(
            lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, example_inputs
        )
    try:
        tp_modules = planned_modules(model, plan.tp_plan, t)
        with local_shapes(model, tp_modules, t):
            planned = partition(model, example_inputs, plan, check_parameters=False)
        layout = planned_sequence_layout(planned, model, tp_modules, example_inputs, plan)
        partial_gradient_parameters(planned.graph_module, tp_modules, layout)
    except UsageError as exc:  # the runtime's refusals (trace, split, sequence parallelism)
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    except Exception as exc:  # noqa: BLE001 - a failure of this check, not a refusal
        # Not the model's fault: refusing T > 1 for it would hide every TP plan (an analytic
        # profile on meta once did); the runtime still refuses at start-up what cannot run.
        log.warning(
            "autopipe: could not check T > 1 at profile time (%s: %s)", type(exc).__name__, exc
        )
        return None
    return None
