"""The example-inputs convention, in one place: what a model is called with, and its batch.

A model's inputs are given as one value (one positional argument), a tuple (positional
arguments) or a dict (keyword arguments); dim 0 of every tensor whose leading size is the
batch size is the batch. The profiler, the planner's callers and both runtimes read inputs
only through this module: splitting them into ``(args, kwargs)``, finding the batch size,
cutting rows out of the batch, and binding a call's arguments to the values a traced graph
takes (:class:`InputBinder`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree
from autopipe.profiler.tree import map_tensors, tensor_leaves

from autopipe.core.errors import UsageError

__all__ = [
    "InputBinder",
    "OutputError",
    "check_joinable_output",
    "batch_rows",
    "batch_size_of",
    "call_model",
    "split_inputs",
]


def split_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Normalise the convention: tuple -> *args, dict -> **kwargs, else one argument."""
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    return (example_inputs,), {}


def call_model(model: Any, example_inputs: Any) -> Any:
    """Call ``model`` with the example inputs under the tuple/dict/single-value convention."""
    args, kwargs = split_inputs(example_inputs)
    return model(*args, **kwargs)


def batch_size_of(value: Any) -> int:
    """Size of dim 0 of the first tensor with at least one dimension in ``value`` (any
    nesting of tuples, lists, dicts and dataclasses). ``TypeError`` if there is none."""
    for t in tensor_leaves(value):
        if t.dim() >= 1:
            return int(t.shape[0])
    raise TypeError(
        "the inputs hold no tensor with a batch dimension (dim 0); pass a batch of samples"
    )


def batch_rows(
    value: Any, start: int, stop: int, batch_size: int | None = None, *, copy: bool = False
) -> Any:
    """Samples ``[start, stop)`` of a batch: every tensor whose dim 0 is ``batch_size``
    (default: :func:`batch_size_of`) is sliced; other tensors (a shared ``(T, T)`` mask) and
    non-tensors are kept. ``copy=True`` clones the slices, so storage-based byte counts see
    only those rows; otherwise they are views."""
    size = batch_size_of(value) if batch_size is None else batch_size

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 1 and t.shape[0] == size:
            piece = t[start:stop]
            return piece.clone() if copy else piece
        return t

    return map_tensors(cut, value)


class OutputError(UsageError, ValueError):
    """The model's output cannot be joined over micro-batches."""


def check_joinable_output(output: Any, batch_size: int) -> None:
    """Refuse an output the pipelines cannot join over micro-batches, before any run.

    Every tensor in the output must have the batch as dim 0 (joined with ``torch.cat``) or
    be a 0-dim floating tensor (a loss: averaged over the micro-batches). O(outputs).
    """
    flat, _ = pytree.tree_flatten_with_path(output)
    for path, leaf in flat:
        if not isinstance(leaf, torch.Tensor):
            continue
        if leaf.dim() == 0 and leaf.is_floating_point():
            continue
        if leaf.dim() >= 1 and leaf.shape[0] == batch_size:
            continue
        where = pytree.keystr(path) or "the output"
        raise OutputError(
            f"the model's output {where} has shape {tuple(leaf.shape)} ({leaf.dtype}), without "
            f"the batch ({batch_size}) as dim 0: a pipeline joins micro-batch outputs along "
            "dim 0 (and averages a 0-dim float loss); return it per sample, or compute it "
            "from the outputs after the pipeline"
        )


def _forward_parameters(model: Any) -> list[inspect.Parameter]:
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError, AttributeError):
        return []
    return list(params)


@dataclass
class InputBinder:
    """Turns a call ``(args, kwargs)`` into the flat values a traced graph's placeholders take.

    A graph is traced from one call: with some arguments positional and some by keyword
    (``traced_positional`` names the positional ones, ``traced_keywords`` the keywords).
    Any later call that binds the same arguments through the forward's signature (e.g. all
    by keyword, or positionally where the trace used keywords) is rebuilt into the traced
    structure and then flattened: through ``in_spec`` for torch.export graphs (pytree
    flattening of ``(args, kwargs)``), else one value per forward parameter in
    ``placeholder_names`` order, defaults filling the ones not given. O(arguments).
    """

    parameter_names: list[str]
    """The forward's named parameters, in order (``*args``/``**kwargs`` excluded)."""
    traced_positional: list[str]
    traced_keywords: list[str]
    placeholder_names: list[str] = field(default_factory=list)
    """fx/hooks graphs: the forward parameter of each placeholder, in order."""
    placeholder_defaults: dict[str, Any] = field(default_factory=dict)
    in_spec: Any = None
    """torch.export graphs: the pytree spec of the traced ``(args, kwargs)``."""

    @classmethod
    def for_trace(
        cls, model: Any, example_inputs: Any, placeholders: Sequence[Any], in_spec: Any = None
    ) -> InputBinder:
        """The binder of a graph traced from ``model(example_inputs)`` (``placeholders``: the
        graph's placeholder nodes; ``in_spec`` for torch.export graphs)."""
        args, kwargs = split_inputs(example_inputs)
        params = [
            p for p in _forward_parameters(model) if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        names = [p.name for p in params]
        positional = names[: len(args)] if len(args) <= len(names) else names
        binder = cls(
            parameter_names=names,
            traced_positional=list(positional),
            traced_keywords=list(kwargs),
            in_spec=in_spec,
        )
        if in_spec is None:
            targets = [str(p.target) for p in placeholders]
            # fx names placeholders after the forward's parameters, in order.
            binder.placeholder_names = names[: len(targets)] if names else targets
            binder.placeholder_defaults = {
                name: node.args[0]
                for name, node in zip(binder.placeholder_names, placeholders, strict=False)
                if node.args
            }
        return binder

    def named(self, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by parameter name. ``TypeError`` names what does not bind."""
        if len(args) > len(self.parameter_names) and self.parameter_names:
            raise TypeError(
                f"got {len(args)} positional inputs but the model's forward takes "
                f"{len(self.parameter_names)} ({', '.join(self.parameter_names)})"
            )
        if not self.parameter_names:
            # A forward without a readable signature: only the traced layout can bind.
            return {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
        values = dict(zip(self.parameter_names, args, strict=False))
        twice = sorted(set(values) & set(kwargs))
        if twice:
            raise TypeError(f"input {twice[0]!r} is given both positionally and by keyword")
        unknown = sorted(set(kwargs) - set(self.parameter_names))
        if unknown:
            raise TypeError(
                f"the model's forward has no argument {unknown[0]!r} "
                f"(it takes {', '.join(self.parameter_names)})"
            )
        values.update(kwargs)
        return values

    def __call__(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
        """The flat placeholder values for the call ``model(*args, **kwargs)``."""
        if not self.parameter_names:
            values = list(args) + list(kwargs.values())
            if self.in_spec is not None:
                return list(fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs)), self.in_spec))
            return values
        named = self.named(args, kwargs)
        if self.in_spec is not None:
            traced = self.traced_positional + self.traced_keywords
            missing = [n for n in traced if n not in named]
            extra = sorted(set(named) - set(traced))
            if missing or extra:
                raise TypeError(
                    "the inputs do not match the traced call "
                    f"({', '.join(traced)})"
                    + (f": {missing[0]!r} is missing" if missing else "")
                    + (f": {extra[0]!r} was not traced (trace with it)" if extra else "")
                )
            call_args = tuple(named[n] for n in self.traced_positional)
            call_kwargs = {n: named[n] for n in self.traced_keywords}
            return list(fx_pytree.tree_flatten_spec((call_args, call_kwargs), self.in_spec))
        flat: list[Any] = []
        for name in self.placeholder_names:
            if name in named:
                flat.append(named[name])
            elif name in self.placeholder_defaults:
                flat.append(self.placeholder_defaults[name])
            else:
                raise TypeError(f"the model input {name!r} is missing from the inputs")
        return flat

    def flat(self, example_inputs: Any) -> list[Any]:
        """:meth:`__call__` on inputs in the example-inputs convention."""
        args, kwargs = split_inputs(example_inputs)
        return self(args, kwargs)
