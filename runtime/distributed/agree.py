"""Ranks agree on what they run: the same plan and model before training, and whether the
loss is finite after each step.

A rank that loaded another plan file (another cut, another M) or built another model would
otherwise train something else and exit 0, or wait in a receive that never comes and blame
a peer after the whole timeout. :func:`check_same_plan` all-gathers a small fingerprint of
both over the world at start-up, so every rank fails within seconds, naming what differs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from autopipe.planner.plan_data import Plan
from torch import nn


class PlanMismatchError(ValueError):
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
    """Every field of the plan's JSON form, flattened (``stages[1].units``, ``microbatches``,
    ``meta``, ...) to a value or a digest, so two fingerprints can say which fields differ."""
    data = plan.to_dict()
    out: dict[str, Any] = {}
    for key in sorted(data):
        if key == "stages" and isinstance(data[key], list):
            out["stages"] = len(data[key])
            for i, stage in enumerate(data[key]):
                for field in sorted(stage):
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


@contextlib.contextmanager
def _collective(what: str) -> Iterator[None]:
    """Turn a peer's failure or silence during a collective into one clear error."""
    # Imported here: pipeline.py imports this module.
    from autopipe.runtime.distributed.pipeline import (
        PipelineRankError,
        _is_comm_failure,
        _short_cause,
    )

    try:
        yield
    except Exception as exc:
        if not _is_comm_failure(exc):
            raise
        raise PipelineRankError(
            f"rank {dist.get_rank()}: could not {what}: a peer rank failed or did not answer "
            f"within the process-group timeout ({_short_cause(exc)})"
        ) from exc


_SALIENT = ("num_stages", "stages", "replicas", "microbatches", "batch_size", "schedule")


def _salience(field: str) -> tuple[int, str]:
    """Fields that change what is trained first (the stage count, M, the cut), so the
    error names the cause rather than a predicted time that follows from it."""
    if field in _SALIENT:
        return _SALIENT.index(field), field
    if field.endswith((".units", ".checkpoint")):
        return len(_SALIENT), field
    return len(_SALIENT) + 1, field


def check_same_plan(plan: Plan, model: nn.Module) -> None:
    """Raise :class:`PlanMismatchError` on every rank unless all ranks hold the same plan
    and a model of the same structure. Collective: every rank of the world must call it."""
    mine = {"plan": plan_fingerprint(plan), "model": model_fingerprint(model)}
    everyone: list[Any] = [None] * dist.get_world_size()
    with _collective("compare plans with the other ranks"):
        dist.all_gather_object(everyone, mine)  # the world group: its timeout bounds the wait
    problem = mismatch(everyone)
    if problem is not None:
        raise PlanMismatchError(problem)


def mismatch(fingerprints: list[dict[str, Any]]) -> str | None:
    """What differs between rank 0's fingerprint and the first rank whose differs (one
    line), or None when all agree. ``fingerprints[r]`` is rank r's ``{"plan": ..., "model":
    ...}``; every rank computes the same answer from the same list."""
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
    return None


_NONFINITE = {1.0: "-inf", 2.0: "inf", 3.0: "nan"}


def nonfinite_loss(loss: torch.Tensor | None, device: torch.device) -> str | None:
    """``"nan"``, ``"inf"`` or ``"-inf"`` on every rank when the loss (known on the last
    stage, None elsewhere) is not finite, else None: one one-element all-reduce over the
    world, so the ranks that never see the loss stop at the same step."""
    code = 0.0
    if loss is not None:
        value = float(loss)
        code = (
            3.0 if math.isnan(value) else 0.0 if math.isfinite(value) else 2.0 if value > 0 else 1.0
        )
    flag = torch.tensor([code], device=device)
    with _collective("share the loss check"):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return _NONFINITE.get(float(flag.item()))
