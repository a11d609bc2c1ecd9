"""Ranks agree on what they run: the same plan, model and traced graph before training, and
whether the loss is finite after each step.

A rank that loaded another plan file (another cut, another M) or built another model would
otherwise train something else and exit 0, or wait in a receive that never comes and blame
a peer after the whole timeout. :func:`check_same_plan` all-gathers a small fingerprint of
each over the world at start-up, so every rank fails within seconds, naming what differs.

The traced graph is compared too (:func:`graph_fingerprint`): the same model can trace into
different graphs in different processes when its ``forward`` depends on a per-process value,
e.g. Hugging Face Gemma-3 iterating ``set(config.layer_types)``, whose order follows the
process's string hash seed (``PYTHONHASHSEED``). Two ranks would then disagree on which
value crosses a cut in which place and train something else than one process does, with
the same plan and the same parameters.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import math
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from autopipe.runtime.distributed.failures import (
    PipelineRankError,
    is_comm_failure,
    on_every_rank,
    short_cause,
)
from autopipe.runtime.planned_stages import PlannedStages
from torch import fx, nn

from autopipe.core.errors import UsageError
from autopipe.core.plan import STAGE_INSTRUCTION_FIELDS, Plan


class PlanMismatchError(UsageError, ValueError):
    """The ranks loaded different plans or built different models."""


def _digest(value: Any) -> str:
    blob = json.dumps(value, sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def _describe(value: Any) -> Any:
    """A scalar as itself; a list or dict as a short, readable digest."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        span = value[0] if len(value) == 1 else f"{value[0]}..{value[-1]}"
        return f"{span} ({len(value)} units, #{_digest(value)})"
    return f"#{_digest(value)}"


def plan_fingerprint(plan: Plan) -> dict[str, Any]:
    """The plan's instructions (``Plan.instructions()``: what every rank acts on; no report
    figure), flattened (``stages[1].units``, ``microbatches``, ...) to a value or a digest,
    so two fingerprints can say which fields differ. Per stage only its
    ``STAGE_INSTRUCTION_FIELDS``: two files that differ in a prediction or a note train the
    same thing. Each rank's ``actions`` as its count and a digest (``actions[1]``); each
    trainer option as itself (``trainer.compile``)."""
    data = plan.instructions()
    out: dict[str, Any] = {}
    for key in sorted(data):
        if key == "actions" and isinstance(data[key], list):
            out["actions"] = len(data[key])
            for rank, order in enumerate(data[key]):
                out[f"actions[{rank}]"] = f"{len(str(order).split())} actions #{_digest(order)}"
        elif key == "trainer" and isinstance(data[key], dict):
            for name in sorted(data[key]):
                out[f"trainer.{name}"] = _describe(data[key][name])
        elif key == "stages" and isinstance(data[key], list):
            out["stages"] = len(data[key])
            for i, stage in enumerate(data[key]):
                for field in sorted(set(stage) & set(STAGE_INSTRUCTION_FIELDS)):
                    out[f"stages[{i}].{field}"] = _describe(stage[field])
        else:
            out[key] = _describe(data[key])
    return out


def model_fingerprint(model: nn.Module) -> dict[str, Any]:
    """The model's class and every parameter's and buffer's name, shape and dtype (values are
    left out: a meta-device build has none, and ranks may initialise differently on purpose)."""
    tensors: list[tuple[str, list[int], str]] = [
        (name, list(t.shape), str(t.dtype))
        for named in (model.named_parameters(), model.named_buffers())
        for name, t in named
    ]
    elements = sum(math.prod(shape) for _, shape, _ in tensors)
    return {
        "digest": _digest([f"{type(model).__module__}.{type(model).__qualname__}", tensors]),
        "summary": f"{type(model).__name__} with {len(tensors)} tensors, {elements:,} elements",
    }


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _target_name(target: Any) -> str:
    """A node's target by name: a string as it is (module path, attribute, method), an
    operator overload as torch names it (``aten.add.Tensor``), a function by module and
    qualified name; never an object id."""
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if name is None:
        return _ADDRESS.sub("", repr(target))
    return f"{module}.{name}" if module else str(name)


def _argument(value: Any, index: dict[fx.Node, int]) -> Any:
    """A node argument as plain JSON-able data: another node by its position in the graph,
    containers element-wise, a device by its type (ranks trace on their own cuda:N), numbers
    and strings as themselves, anything else by a repr without object addresses."""
    if isinstance(value, fx.Node):
        return f"%{index[value]}"
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_argument(v, index) for v in value]]
    if isinstance(value, dict):
        return {"dict": [[str(k), _argument(v, index)] for k, v in value.items()]}
    if isinstance(value, slice):
        return ["slice", [_argument(v, index) for v in (value.start, value.stop, value.step)]]
    if isinstance(value, torch.device):
        return f"device:{value.type}"
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}:{value.dtype}"
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    return _ADDRESS.sub("", repr(value))


def _graph_records(module: fx.GraphModule) -> list[Any]:
    """Every node of ``module``'s graph, in order: its kind, target and arguments (other
    nodes by position). Node names, metadata and object ids are left out."""
    index = {node: i for i, node in enumerate(module.graph.nodes)}
    return [
        [
            node.op,
            _target_name(node.target),
            _argument(node.args, index),
            _argument(node.kwargs, index),
        ]
        for node in module.graph.nodes
    ]


def graph_fingerprint(planned: PlannedStages) -> dict[str, Any]:
    """A digest of the traced model as cut for the plan: per stage graph (chunk), every node's
    kind, target and arguments in order, and how many values cross each cut; equal in every
    process that traces the same graph, whatever its object ids or device index.
    ``{"digest": ..., "stages": [digest per stage], "nodes": [node count per stage]}``."""
    stages = []
    for stage in planned.stages:
        records = _graph_records(stage.module)
        stages.append(
            (_digest([records, len(stage.input_names), len(stage.output_names)]), len(records))
        )
    return {
        "digest": _digest([d for d, _ in stages]),
        "stages": [d for d, _ in stages],
        "nodes": [n for _, n in stages],
    }


@contextlib.contextmanager
def _collective(what: str) -> Iterator[None]:
    """Turn a peer's failure or silence during a collective into one clear error."""

    try:
        yield
    except Exception as exc:
        if not is_comm_failure(exc):
            raise
        raise PipelineRankError(
            f"rank {dist.get_rank()}: could not {what}: a peer rank failed or did not answer "
            f"within the process-group timeout ({short_cause(exc)})"
        ) from exc


_SALIENT = ("num_stages", "stages", "data_parallel", "microbatches", "batch_size", "schedule")


def _salience(field: str) -> tuple[int, str]:
    """Fields that change what is trained first (the stage count, M, the cut), so the
    error names the cause rather than a predicted time that follows from it."""
    if field in _SALIENT:
        return _SALIENT.index(field), field
    if field.endswith((".units", ".checkpoint")):
        return len(_SALIENT), field
    if field.startswith("actions"):  # follow from the schedule, K, V and M: named last
        return len(_SALIENT) + 2, field
    return len(_SALIENT) + 1, field


def check_same_plan(
    plan: Plan,
    model: nn.Module,
    planned: PlannedStages | None = None,
    failure: str | None = None,
) -> None:
    """Raise :class:`PlanMismatchError` on every rank unless all ranks hold the same plan, a
    model of the same structure and, with ``planned`` (this rank's stage graphs of the
    model), the same traced graph (:func:`graph_fingerprint`). ``failure``: the one-line
    error with which this rank could not cut the model into the plan's stages (instead of
    ``planned``); when only some ranks failed, or failed differently, every rank raises,
    naming the first; when all failed alike this returns and each rank raises its own.
    Collective: every rank of the world must call it."""
    mine = {
        "plan": plan_fingerprint(plan),
        "model": model_fingerprint(model),
        "graph": graph_fingerprint(planned) if planned is not None else None,
        "failure": failure,
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    with _collective("compare plans with the other ranks"):
        dist.all_gather_object(everyone, mine)  # the world group: its timeout bounds the wait
    problem = mismatch(everyone)
    if problem is not None:
        raise on_every_rank(PlanMismatchError(problem))  # every rank found it, from one list


def mismatch(fingerprints: list[dict[str, Any]]) -> str | None:
    """What differs between rank 0's fingerprint and the first rank whose differs (one
    line), or None when all agree. ``fingerprints[r]`` is rank r's ``{"plan": ..., "model":
    ..., "graph": ..., "failure": ...}`` (the last two optional); the plan is compared first,
    then the model, then whether the cut failed, then the traced graph, so the message names
    the cause rather than what follows from it. Every rank computes the same answer from the
    same list."""
    reference = fingerprints[0]
    for rank, theirs in enumerate(fingerprints):
        if theirs["plan"] != reference["plan"]:
            ours, other = reference["plan"], theirs["plan"]
            fields = sorted(
                (k for k in set(ours) | set(other) if ours.get(k) != other.get(k)), key=_salience
            )
            first = fields[0]
            more = f" (and {len(fields) - 1} more field(s): {', '.join(fields[1:4])})"
            return (
                f"the ranks loaded different plans: {first} is {other.get(first)!r} on rank "
                f"{rank} but {ours.get(first)!r} on rank 0{more if len(fields) > 1 else ''}; "
                "give every rank the same --plan file"
            )
        if theirs["model"]["digest"] != reference["model"]["digest"]:
            return (
                f"the ranks built different models: {theirs['model']['summary']} "
                f"(#{theirs['model']['digest']}) on rank {rank} but "
                f"{reference['model']['summary']} (#{reference['model']['digest']}) on rank 0; "
                "run every rank with the same MODEL.py[:FACTORY]"
            )
    for rank, theirs in enumerate(fingerprints):
        ours, other = reference.get("failure"), theirs.get("failure")
        if other != ours:
            if ours is None:
                what = f"rank {rank} could not cut the model into the plan's stages ({other})"
                what += " but rank 0 could"
            elif other is None:
                what = f"rank 0 could not cut the model into the plan's stages ({ours})"
                what += f" but rank {rank} could"
            else:
                what = (
                    f"the ranks could not cut the model into the plan's stages, differently: "
                    f"{other} on rank {rank}, {ours} on rank 0"
                )
            return f"{what}; run every rank with the same files and PYTHONHASHSEED"
    for rank, theirs in enumerate(fingerprints):
        ours, other = reference.get("graph"), theirs.get("graph")
        if ours is None or other is None or other["digest"] == ours["digest"]:
            continue
        # The plans agree (compared first), so both list one digest per stage.
        stage = next(
            k
            for k, (a, b) in enumerate(zip(ours["stages"], other["stages"], strict=True))
            if a != b
        )
        return (
            f"rank {rank} traced a different graph of the model than rank 0 (stage {stage}: "
            f"#{other['stages'][stage]}, {other['nodes'][stage]} nodes on rank {rank}; "
            f"#{ours['stages'][stage]}, {ours['nodes'][stage]} nodes on rank 0), e.g. a "
            "forward that iterates a set; set the same PYTHONHASHSEED on every rank"
        )
    return None


def nonfinite(loss: float) -> str | None:
    """``"nan"``, ``"inf"`` or ``"-inf"`` when the step's global loss is not finite, else
    None. Every rank has that loss (``DistributedPipeline.last_loss``: the step's one
    all-reduce of the loss sum and item count), so the ranks that never compute the loss
    stop at the same step without a collective of their own."""
    if math.isnan(loss):
        return "nan"
    if math.isinf(loss):
        return "inf" if loss > 0 else "-inf"
    return None
