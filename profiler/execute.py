"""Run a model unit by unit: split the traced graph into one submodule per unit and record
each unit's real inputs and outputs from one full forward pass.

Each unit becomes a standalone callable (``split_module`` partition ``submod_<unit>``) that
can be timed in isolation on its captured inputs. Units that are the same computation as an
earlier one (``share``, see :mod:`autopipe.profiler.signature`) need not run: the earlier
unit's outputs stand in for theirs, so a forward through 48 identical blocks runs one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from autopipe.profiler.units import UnitGraph
from torch import fx, nn
from torch.fx.passes.split_module import split_module


@dataclass
class UnitCall:
    """One unit's callable with the argument values it received in the full forward pass.

    ``activation_args[i]`` is True when ``args[i]`` is the output of an earlier unit (an
    activation, to be detached and given ``requires_grad`` when the unit runs alone); False
    for model inputs, parameters and buffers, which are passed unchanged.
    """

    index: int
    module: fx.GraphModule
    args: tuple[Any, ...]
    activation_args: tuple[bool, ...]
    outputs: Any
    same_as: int | None = None
    """Index of the earlier unit whose outputs stood in for this unit's (it did not run)."""


ShareFn = Callable[[int, fx.GraphModule, tuple[Any, ...], tuple[bool, ...]], int | None]
"""``share(index, module, args, activation_args)``: the index of an earlier unit that ran and
is the same computation (its outputs stand in), or None to run this unit."""
AfterFn = Callable[[UnitCall], Any]
"""``after(call)`` runs after each unit that ran; a non-None result replaces its outputs."""
InputsFn = Callable[[int, fx.GraphModule, tuple[Any, ...], tuple[bool, ...]], tuple[Any, ...]]
"""``inputs(index, module, args, activation_args)``: the arguments to run the unit on (e.g.
copies a unit may write into); the call records the original ``args``."""
RunnerFn = Callable[[int, fx.GraphModule], Callable[..., Any]]
"""``runner(index, module)``: what to call for the unit (e.g. its ``torch.compile``'d
module); the call records ``module`` itself."""


def split_units(ug: UnitGraph, model: nn.Module) -> fx.GraphModule:
    """``split_module`` with one partition per unit; partition ``i`` is ``submod_<i>``.

    Submodules and ``get_attr`` targets are resolved on ``model``, so the partitions share
    the model's parameters. O(nodes).
    """
    node_unit = ug.node_unit
    return split_module(ug.graph_module, model, lambda node: node_unit[node.name])


class _CaptureInterpreter(fx.Interpreter):
    """Runs the split top-level graph and records each partition call."""

    def __init__(
        self,
        split: fx.GraphModule,
        on_call: Callable[[int, Any], None] | None,
        share: ShareFn | None = None,
        after: AfterFn | None = None,
        inputs: InputsFn | None = None,
        runner: RunnerFn | None = None,
    ) -> None:
        super().__init__(split)
        self.calls: list[UnitCall] = []
        self.on_call = on_call
        self.share = share
        self.after = after
        self.inputs = inputs
        self.runner = runner
        self._ran: dict[int, UnitCall] = {}
        # Which values of the top graph are unit outputs (a partition call or its getitem).
        self._activation: set[str] = set()

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        name = str(target)
        if not name.startswith("submod_"):
            return super().call_module(target, args, kwargs)
        index = int(name.removeprefix("submod_"))
        module = self.fetch_attr(name)
        node_args = self._current.args
        flags = tuple(isinstance(a, fx.Node) and a.name in self._activation for a in node_args)
        same = None if self.share is None or kwargs else self.share(index, module, args, flags)
        if same is not None:
            out = self._ran[same].outputs
            self.calls.append(UnitCall(index, module, tuple(args), flags, out, same_as=same))
            return out
        if self.on_call is not None:
            self.on_call(index, module)
        run_args = (
            tuple(args) if self.inputs is None else self.inputs(index, module, tuple(args), flags)
        )
        fn = module if self.runner is None else self.runner(index, module)
        call = UnitCall(index, module, tuple(args), flags, fn(*run_args, **kwargs))
        if self.after is not None:
            # ``call`` holds the only reference to the outputs, so ``after`` may free their
            # autograd graph (and with it the unit's weights) by replacing them.
            replaced = self.after(call)
            if replaced is not None:
                call.outputs = replaced
        self.calls.append(call)
        self._ran[index] = call
        return call.outputs

    def run_node(self, n: fx.Node) -> Any:
        self._current = n
        out = super().run_node(n)
        if n.op == "call_module" and str(n.target).startswith("submod_"):
            self._activation.add(n.name)
        elif n.op == "call_function" and any(a.name in self._activation for a in n.all_input_nodes):
            self._activation.add(n.name)  # getitem of a partition's output tuple
        return out


def run_units(
    split: fx.GraphModule,
    flat_inputs: list[Any],
    on_call: Callable[[int, Any], None] | None = None,
    *,
    share: ShareFn | None = None,
    after: AfterFn | None = None,
    inputs: InputsFn | None = None,
    runner: RunnerFn | None = None,
) -> tuple[Any, list[UnitCall]]:
    """Run the split model once on the flat placeholder values; return its output and the
    unit calls in execution order. ``on_call(unit_index, module)`` runs before each unit
    that runs (e.g. to tag saved-tensor accounting); ``share`` and ``after``: see
    :data:`ShareFn`, :data:`AfterFn`, :data:`InputsFn` and :data:`RunnerFn`. Stand-in calls
    (``same_as`` set) are listed too."""
    interp = _CaptureInterpreter(split, on_call, share, after, inputs, runner)
    out = interp.run(*flat_inputs)
    return out, interp.calls


def fresh_inputs(args: tuple[Any, ...], activation_args: tuple[bool, ...]) -> tuple[Any, ...]:
    """Copies of the activation arguments that are safe to modify in place.

    A unit may start with an in-place op on its input (``nn.ReLU(inplace=True)``), which
    autograd forbids on a leaf that requires grad and which would also change the input of
    the next timed run. Each activation ``a`` becomes ``a.clone()``: a non-leaf whose
    gradient still reaches ``a``; the copy is made before the timed region.
    """
    return tuple(
        a.clone() if flag and isinstance(a, torch.Tensor) else a
        for a, flag in zip(args, activation_args, strict=True)
    )


def detach_args(call: UnitCall) -> tuple[Any, ...]:
    """The unit's arguments with activations detached into fresh leaves that require grad
    when the original did, so backward stops at the unit boundary."""
    out = []
    for value, is_activation in zip(call.args, call.activation_args, strict=True):
        if is_activation and isinstance(value, torch.Tensor):
            leaf = value.detach()
            if value.requires_grad:
                leaf.requires_grad_(True)
            out.append(leaf)
        else:
            out.append(value)
    return tuple(out)
