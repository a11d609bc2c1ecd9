"""The training objective: ``loss_fn(output, inputs)``, or one default shared by every phase.

**One micro-batch at a time, everywhere.** Every runtime that calls the objective calls it on
one micro-batch: that micro-batch's output (the model's own ``ModelOutput``, dict, tuple or
tensor, never a flattened form) and its rows of the inputs, in the example-inputs convention.
``autopipe run`` (torch's schedules compute the loss on the last stage, micro-batch by
micro-batch), ``Pipeline.loss`` (the one-process GPipe executor, ``autopipe bench``) and
profiling (which times the loss at each micro-batch size) all do, so a loss written once
trains the same way in all of them.

**What a loss returns.** Either

- a scalar tensor: the *mean* over the micro-batch's rows (samples); or
- a pair ``(sum, count)``: the sum of per-item losses and how many items it sums over (the
  labelled tokens of a language model, say), as gradient accumulation in the ecosystem does
  (transformers' ``num_items_in_batch``).

The mini-batch's loss is then ``sum of the sums / sum of the counts`` over its micro-batches
(a mean is its sum over ``rows``), so it is the unpipelined model's loss whenever that loss is
a mean over rows or items, however the labelled items fall into micro-batches. A loss that
looks at a row's *position* in the batch, or at other rows (batch statistics, in-batch
negatives), sees only its micro-batch.

**Without a loss_fn** the default is:

- the loss the model computed itself, when its output carries one (a Hugging Face model
  called with ``labels=`` returns ``output.loss``; a dict output with a ``"loss"`` entry),
  weighted by the items it averages over: :class:`LabelItems` counts them from the
  micro-batch's ``labels`` the way the model's loss does;
- otherwise the mean square of every floating-point output tensor, summed over them (a
  mean over rows).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from autopipe.profiler.inputs import batch_size_of
from autopipe.profiler.tree import float_tensor_leaves
from torch import nn

from autopipe.core.errors import UsageError

__all__ = [
    "IGNORE_INDEX",
    "LabelItems",
    "LossFn",
    "LossTerm",
    "ObjectiveError",
    "combine",
    "default_loss",
    "loss_of",
    "loss_term",
    "model_loss",
]

LossValue = torch.Tensor | tuple[torch.Tensor, Any]
"""What a ``loss_fn`` returns: a mean over rows, or ``(sum, count)``."""

LossFn = Callable[[Any, Any], LossValue]

IGNORE_INDEX = -100
"""The label that losses skip (PyTorch's ``cross_entropy`` default, Hugging Face's padding)."""


class ObjectiveError(UsageError, ValueError):
    """The model's output gives nothing to drive backward with, or a ``loss_fn`` returned
    something that is neither a scalar nor a ``(sum, count)`` pair."""


@dataclass(frozen=True)
class LabelItems:
    """How a model's own loss counts the items it averages over, from its ``labels`` input.

    ``shifted``: the loss predicts token ``t + 1`` from token ``t`` (a causal LM), so the
    first label of each row is never counted. Integer labels count where they are not
    :data:`IGNORE_INDEX`; floating labels (regression, multi-label) count every element;
    without labels a micro-batch counts its rows.
    """

    shifted: bool = False

    @classmethod
    def of(cls, model: nn.Module) -> LabelItems:
        """The rule of ``model``'s own loss. Hugging Face models name their loss by their
        class (``loss_type``); only the causal-LM loss of a decoder-only model shifts, as
        transformers' Trainer counts ``num_items_in_batch``. A model whose class names no
        loss falls back to the causal-LM loss in transformers (GPT-2's LM head), and so here."""
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "loss_type"):
            return cls(shifted=False)
        try:
            from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
        except ImportError:  # an HF-like model without transformers: nothing shifts
            return cls(shifted=False)
        loss_type = getattr(model, "loss_type", None) or getattr(config, "loss_type", None)
        loss = LOSS_MAPPING.get(str(loss_type), ForCausalLMLoss)
        shifted = loss is ForCausalLMLoss and not getattr(config, "is_encoder_decoder", False)
        return cls(shifted=bool(shifted))

    def count(self, inputs: Any) -> float:
        """The items the model's own loss averages over in this micro-batch's ``inputs``."""
        labels = inputs.get("labels") if isinstance(inputs, Mapping) else None
        if not isinstance(labels, torch.Tensor) or labels.dim() == 0:
            return float(_rows(inputs))
        if labels.is_floating_point():
            return float(labels.numel())
        valid = labels[..., 1:] if self.shifted and labels.dim() > 1 else labels
        return float((valid != IGNORE_INDEX).sum())


@dataclass
class LossTerm:
    """One micro-batch's part of the mini-batch loss: ``total`` (with its autograd graph)
    summed over ``items``. The mini-batch loss is :func:`combine` of its terms."""

    total: torch.Tensor
    items: float


def model_loss(output: Any) -> torch.Tensor | None:
    """The scalar loss the model returned itself (``output.loss`` or ``output["loss"]``),
    or None."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
        return loss
    return None


def _squares(output: Any) -> torch.Tensor:
    tensors = [t for t in float_tensor_leaves(output) if t.numel() > 0]
    # Outputs that carry no gradient (a detached statistic) add nothing to backward.
    tensors = [t for t in tensors if t.requires_grad] or tensors
    if not tensors:
        raise ObjectiveError(
            "the model output holds no floating-point tensor to drive backward; define "
            "loss_fn(output, inputs) in the model file (or pass loss_fn=...)"
        )
    return torch.stack([t.float().pow(2).mean() for t in tensors]).sum()


def default_loss(output: Any, inputs: Any = None) -> torch.Tensor:
    """The model's own loss if it returns one, else the summed mean squares of its floating
    outputs (see the module docstring). ``ObjectiveError`` if there is neither."""
    own = model_loss(output)
    return own if own is not None else _squares(output)


def _rows(inputs: Any) -> int:
    try:
        return batch_size_of(inputs)
    except (TypeError, ValueError):
        return 1


def _zero_total(output: Any) -> torch.Tensor:
    """A zero loss still attached to ``output`` (a micro-batch with nothing to count: the
    model's own mean over zero items is NaN, and so would be its gradient)."""
    leaves = [t for t in float_tensor_leaves(output) if t.requires_grad and t.dim() > 0]
    if not leaves:
        return torch.zeros(())
    return torch.stack([t.sum() for t in leaves]).sum() * 0.0


def loss_term(
    output: Any,
    inputs: Any,
    loss_fn: LossFn | None,
    items: LabelItems | None = None,
) -> LossTerm:
    """One micro-batch's :class:`LossTerm`: ``loss_fn(output, inputs)`` (a mean over rows, or
    ``(sum, count)``), else the default objective (the model's own loss weighted by
    ``items``, the rule of :meth:`LabelItems.of`, or the mean squares over rows)."""
    if loss_fn is None:
        own = model_loss(output)
        if own is not None:
            count = (items or LabelItems()).count(inputs)
            if count == 0:
                return LossTerm(_zero_total(output), 0.0)
            return LossTerm(own * count, count)
        value: Any = _squares(output)
    else:
        value = loss_fn(output, inputs)
    return _as_term(value, inputs)


def _as_term(value: Any, inputs: Any) -> LossTerm:
    if isinstance(value, Sequence) and not isinstance(value, torch.Tensor):
        if len(value) != 2 or not isinstance(value[0], torch.Tensor):
            raise ObjectiveError(
                "loss_fn returned a sequence of "
                f"{len(value)}; return a scalar mean, or (sum, count): a scalar tensor "
                "summed over count items"
            )
        total, count = value
        count = float(count.detach()) if isinstance(count, torch.Tensor) else float(count)
        if total.dim() != 0 or count < 0:
            raise ObjectiveError(
                f"loss_fn returned (sum, count) with a sum of shape {tuple(total.shape)} and "
                f"count {count}; the sum must be a scalar and the count >= 0"
            )
        return LossTerm(total, count)
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ObjectiveError(
            f"loss_fn returned {shape}; return a scalar tensor (the mean over the "
            "micro-batch's rows) or (sum, count)"
        )
    rows = _rows(inputs)
    return LossTerm(value * rows, float(rows))


def combine(terms: Sequence[LossTerm]) -> torch.Tensor:
    """The mini-batch loss of its micro-batches' terms: the sum of the sums over the sum of
    the counts (zero when nothing was counted)."""
    items = sum(t.items for t in terms)
    total = torch.stack([t.total.float() for t in terms]).sum()
    return total / items if items > 0 else total * 0.0


def loss_of(output: Any, inputs: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """The loss of one (micro-)batch as a scalar to call ``backward`` on: ``loss_fn``'s mean,
    or its ``sum / count``, else :func:`default_loss`."""
    if loss_fn is None:
        return default_loss(output, inputs)
    value = loss_fn(output, inputs)
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value
    term = _as_term(value, inputs)
    return term.total / term.items if term.items > 0 else term.total * 0.0
