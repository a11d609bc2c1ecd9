"""One stage on one micro-batch as an autograd node of the caller's graph.

Design (why backward is identical to the unsplit model and still per-stage): each task
``(stage j, micro-batch i)`` is one ``StageFunction`` node. Its forward detaches the incoming
tensors, moves them to the stage's device and runs the stage under ``enable_grad`` (through
``torch.utils.checkpoint`` when re-materializing), keeping that private autograd graph in
the node. Its backward, which the caller's ``loss.backward()`` reaches through the gathered
output, runs ``torch.autograd.backward`` on the private graph: parameter gradients
accumulate into ``.grad`` exactly as in the unsplit model (summed over micro-batches, and
over both uses of a tied parameter), and the gradients of the detached inputs are returned
to the previous stage's node. So autograd itself drives the backward in reverse
dependency order, one (stage, micro-batch) at a time, and every backward (and recompute) is
timed. On CUDA the engine runs each node on its device's thread, so stages on different
GPUs overlap in backward as they do in forward.

Consequences: gradients reach parameters through ``.grad`` accumulation, so use
``loss.backward()`` (``torch.autograd.grad`` w.r.t. parameters, ``create_graph=True`` and
a second backward through the same output are not supported); gradients w.r.t. pipeline
inputs that require grad are returned as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["StageFunction", "phony"]

_PHONIES: dict[str, torch.Tensor] = {}


def phony(device: torch.device) -> torch.Tensor:
    """An empty leaf that requires grad: makes every stage node part of the backward graph
    even when none of its inputs requires grad (stage 0)."""
    key = str(device)
    t = _PHONIES.get(key)
    if t is None:
        t = _PHONIES[key] = torch.empty(0, device=device, requires_grad=True)
    return t


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        leaf = value.detach()
        if value.requires_grad:
            leaf.requires_grad_(True)
        return leaf
    return value


class StageFunction(torch.autograd.Function):
    """``StageFunction.apply(run, on_backward, phony, *inputs) -> tuple(outputs)``.

    ``run(*inputs)`` computes the stage on detached inputs and returns a tuple (tensors and
    any other values); ``on_backward()`` returns a context manager entered around the
    stage's backward (timeline record). Outputs that do not depend on anything requiring grad
    are marked non-differentiable. Only top-level tensors are tracked, so inputs and outputs
    must be flat (the executor flattens tuples and dicts around the node).
    """

    @staticmethod
    def forward(
        ctx: Any,
        run: Callable[..., Sequence[Any]],
        on_backward: Callable[[], Any],
        phony_leaf: torch.Tensor,
        *inputs: Any,
    ) -> tuple[Any, ...]:
        ctx.set_materialize_grads(False)
        leaves = [_detach(x) for x in inputs]
        with torch.enable_grad():
            outputs = tuple(run(*leaves))
        returned = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs)
        ctx.mark_non_differentiable(
            *(
                r
                for o, r in zip(outputs, returned, strict=True)
                if isinstance(o, torch.Tensor) and not o.requires_grad
            )
        )
        ctx.leaves = leaves
        ctx.outputs = outputs
        ctx.on_backward = on_backward
        return returned

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if not hasattr(ctx, "outputs"):
            raise RuntimeError(
                "backward through a pipeline output ran twice; run the pipeline forward again "
                "for each backward (retain_graph is not supported)"
            )
        tensors, grad_tensors = [], []
        for out, grad in zip(ctx.outputs, grads, strict=True):
            if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None:
                tensors.append(out)
                grad_tensors.append(grad)
        with ctx.on_backward():
            if tensors:
                torch.autograd.backward(tensors, grad_tensors)
        leaves = ctx.leaves
        del ctx.outputs, ctx.leaves
        input_grads = tuple(
            leaf.grad if isinstance(leaf, torch.Tensor) and leaf.requires_grad else None
            for leaf in leaves
        )
        return (None, None, None, *input_grads)
