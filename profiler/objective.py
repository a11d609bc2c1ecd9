"""The training objective: ``loss_fn(output, inputs)``, or one default shared by every phase.

Profiling, ``parallelize`` and ``autopipe run`` all call the objective on the model's own
output (its ``ModelOutput``, dict, tuple or tensor, never a flattened form) and the inputs
in the example-inputs convention, so a loss written once works in all three. Without a
``loss_fn`` the default is:

- the loss the model computed itself, when its output carries one (a Hugging Face model
  called with ``labels=`` returns ``output.loss``; a dict output with a ``"loss"`` entry);
- otherwise the mean square of every floating-point output tensor, summed over them.

Both are means over the samples of a micro-batch, so the mean over equal micro-batches is
the loss of the whole mini-batch and pipelined gradients equal unpipelined ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from autopipe.profiler.tree import float_tensor_leaves

__all__ = ["LossFn", "ObjectiveError", "default_loss", "loss_of", "model_loss"]

LossFn = Callable[[Any, Any], torch.Tensor]


class ObjectiveError(ValueError):
    """The model's output gives nothing to drive backward with."""


def model_loss(output: Any) -> torch.Tensor | None:
    """The scalar loss the model returned itself (``output.loss`` or ``output["loss"]``),
    or None."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
        return loss
    return None


def default_loss(output: Any, inputs: Any = None) -> torch.Tensor:
    """The model's own loss if it returns one, else the summed mean squares of its floating
    outputs (see the module docstring). ``ObjectiveError`` if there is neither."""
    own = model_loss(output)
    if own is not None:
        return own
    tensors = [t for t in float_tensor_leaves(output) if t.numel() > 0]
    # Outputs that carry no gradient (a detached statistic) add nothing to backward.
    tensors = [t for t in tensors if t.requires_grad] or tensors
    if not tensors:
        raise ObjectiveError(
            "the model output holds no floating-point tensor to drive backward; define "
            "loss_fn(output, inputs) in the model file (or pass loss_fn=...)"
        )
    return torch.stack([t.float().pow(2).mean() for t in tensors]).sum()


def loss_of(output: Any, inputs: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """``loss_fn(output, inputs)`` or :func:`default_loss`."""
    if loss_fn is not None:
        return loss_fn(output, inputs)
    return default_loss(output, inputs)
