"""Measured profiling: run the model unit by unit on a real device and time/count each unit.

``profile(model, example_inputs)``:

1. trace the model into units (:mod:`autopipe.profiler.units`);
2. run one full forward through the per-unit split graph, recording every unit's real
   inputs, and count the bytes each unit saves for backward (saved-tensor hooks, one count
   per storage);
3. time every unit alone on its recorded inputs: forward, then backward from ones-like
   output gradients to its activation inputs and parameters (median after warm-up);
4. time the loss (``loss_fn(output, inputs)``, or the default objective of
   :mod:`autopipe.profiler.objective`) and
   add it to the last unit: the last pipeline stage computes it;
5. time the whole model in one piece (forward + loss, backward) and count its saved bytes,
   as the reference the per-unit figures must add up to;
6. optionally repeat 2-3 at smaller micro-batch sizes, in the same rounds, and fit
   ``t(b) = a + c * b`` per unit.

Cost: (warmup + repeat) forward+backward passes per unit per micro-batch size, plus as many
whole-model passes.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import platform
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import tqdm.auto
from autopipe.profiler import inputs as inputs_convention
from autopipe.profiler import objective
from autopipe.profiler.cache import cache_key, cache_path, load_cached, save_cached
from autopipe.profiler.context_expert import annotate_context_expert
from autopipe.profiler.execute import (
    UnitCall,
    detach_args,
    fresh_inputs,
    run_units,
    split_units,
)
from autopipe.profiler.header import profile_header
from autopipe.profiler.inputs import call_model
from autopipe.profiler.materialize import (
    Materializer,
    meta_node_bytes,
    on_meta,
    own_meta_state,
    retarget_devices,
    to_meta,
    unit_state,
)
from autopipe.profiler.memory import (
    SavedTensorCounter,
    canonical_parameter_names,
    parameter_accounting,
    parameter_storages,
    storage_key,
    tensor_bytes,
)
from autopipe.profiler.objective import LossFn
from autopipe.profiler.opcount import WeightMatmulCounter, parameter_storage_keys
from autopipe.profiler.options import MeasureOptions
from autopipe.profiler.sharing import UnitSharing
from autopipe.profiler.tensor_parallel import annotate_tensor_parallel
from autopipe.profiler.time_model import fit_time_model
from autopipe.profiler.timing import (
    CUDA_EVENTS,
    TimedStep,
    num_threads,
    resolve_clock,
    synchronize,
    time_steps_interleaved,
)
from autopipe.profiler.trace import batch_is_dynamic
from autopipe.profiler.tree import float_tensor_leaves, map_tensors, tensor_leaves
from autopipe.profiler.units import UnitGraph, cut_tensors, trace_units
from autopipe.profiler.weight_pass import reuse_reason, reused_parameters
from torch import fx, nn

from autopipe.core.errors import UsageError
from autopipe.core.optimizer import normalize_optimizer, resolve_optimizer
from autopipe.core.profile import Profile, UnitProfile

log = logging.getLogger("autopipe")


class ProfilingError(UsageError, RuntimeError):
    """The model cannot be profiled as given (e.g. no output to drive backward)."""


# ---------------------------------------------------------------------------------------
# Inputs, devices, dtypes


def resolve_device(model: nn.Module, device: str | torch.device | None) -> torch.device:
    """The requested device, else the device of the model's first parameter, else CPU."""
    if device is not None:
        return torch.device(device)
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def resolve_dtype(model: nn.Module, dtype: str | torch.dtype | None) -> torch.dtype:
    """The requested floating dtype (``"bfloat16"``, ``torch.float16``, ...) or the model's."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        value = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(value, torch.dtype) or not value.is_floating_point:
            raise ValueError(
                f"dtype {dtype!r} is not a torch floating dtype; use e.g. 'float32' or 'bfloat16'"
            )
        return value
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def move_inputs(example_inputs: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Inputs on ``device``; floating tensors cast to ``dtype`` (integer ids stay integer)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)
        return t.to(dtype) if t.is_floating_point() else t

    return map_tensors(move, example_inputs)


def _batch_size(example_inputs: Any) -> int:
    """Size of dim 0 of the first tensor with at least one dimension
    (:func:`autopipe.profiler.inputs.batch_size_of`), as a :class:`ProfilingError`."""
    try:
        return inputs_convention.batch_size_of(example_inputs)
    except TypeError as exc:
        raise ProfilingError(str(exc)) from None


def slice_batch(example_inputs: Any, size: int, batch_size: int) -> Any:
    """The first ``size`` samples, copied (so storage-based byte counts see ``size``
    samples, not the whole batch)."""
    return inputs_convention.batch_rows(example_inputs, 0, size, batch_size, copy=True)


def microbatch_sizes_to_profile(
    batch_size: int, microbatch_sizes: Sequence[int] | None = None
) -> list[int]:
    """``[B, smaller sizes, descending]`` to count or time for the ``t(b) = a + c * b`` fit.

    ``None``: ``B`` and one size dividing it (``B/4``, else ``B/2``), enough for a line;
    ``()``: ``B`` only. ``ValueError`` for a size outside ``1..B``.
    """
    if microbatch_sizes is None:
        for divisor in (4, 2):
            if batch_size % divisor == 0:
                return [batch_size, batch_size // divisor]
        return [batch_size]
    sizes = [
        batch_size,
        *sorted({int(b) for b in microbatch_sizes if int(b) != batch_size}, reverse=True),
    ]
    bad = [b for b in sizes if not 1 <= b <= batch_size]
    if bad:
        raise ValueError(
            f"micro-batch sizes must be between 1 and the batch size {batch_size}, got {bad}"
        )
    return sizes


def _loss(output: Any, inputs: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """The objective (:func:`autopipe.profiler.objective.loss_of`: ``loss_fn`` or the
    default shared with both runtimes) as a :class:`ProfilingError` when there is none."""
    try:
        return objective.loss_of(output, inputs, loss_fn)
    except objective.ObjectiveError as exc:
        raise ProfilingError(str(exc)) from None


# ---------------------------------------------------------------------------------------
# Model state that profiling must leave as it found it


@contextmanager
def _preserved(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Train mode and a forked RNG during profiling; afterwards the modules' train/eval
    flags, the buffers (BatchNorm statistics) and the parameters' ``.grad`` are restored."""
    modes = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            model.train()
            yield
    finally:
        for m, training in modes:
            m.training = training
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g


# ---------------------------------------------------------------------------------------
# One micro-batch size


SHARED_SAMPLES_CAP = 4
"""A measurement that ``k`` identical units share is timed ``min(k, SHARED_SAMPLES_CAP)``
times per round: part of the time the copies would have cost buys a steadier median."""


@dataclass
class _UnitMeasurement:
    forward_s: float = 0.0
    backward_s: float = 0.0
    activation_bytes: int = 0
    output_bytes: int = 0
    peak_bytes: int = 0
    backward_input_s: float = 0.0
    backward_weight_s: float = 0.0
    split_samples: list[tuple[float, float]] = field(default_factory=list)
    """(B, W) seconds of each run of the unit's split-backward step (warm-up runs first)."""
    unsplit_reason: str = ""
    """Why the unit's backward cannot be split into B and W (``UnitProfile.backward_unsplit``);
    "" when it can (or was not tried)."""


@dataclass
class _SizeMeasurement:
    units: list[_UnitMeasurement]
    cut_bytes: list[int] = field(default_factory=list)
    loss_forward_s: float = 0.0
    loss_backward_s: float = 0.0
    input_bytes: int = 0
    unit_of_step: list[int] = field(default_factory=list)
    """Unit index of each timed step returned with this measurement (the loss comes after)."""
    same_as: list[int] = field(default_factory=list)
    """Per unit, the unit whose measurement it shares (itself when measured on its own)."""
    timed: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Units already timed while capturing (one unit at a time, from the meta device)."""
    split_of_step: list[int] = field(default_factory=list)
    """Unit index of each split-backward step, returned after the loss step."""
    loss_activation_bytes: int = 0
    materialized_peak_bytes: int = 0
    """Most parameter and buffer bytes materialized at once (models on the meta device)."""
    peak_estimated: bool = True
    """``peak_bytes`` are saved + output + input-gradient bytes (no allocator statistics)."""


@dataclass
class _Timing:
    """How to time: what ``time_steps_interleaved`` needs, for units timed one at a time."""

    warmup: int
    repeat: int
    clock: str | Callable[[], float]
    tick: Callable[[], None] | None = None
    """Called after each unit is timed."""
    expect: Callable[[int], None] | None = None
    """Called once per micro-batch size, before its units run, with how many will be timed
    (``UnitSharing.expected_runs``): the progress bar's total."""


class _UnitsProgress:
    """The bar of a model timed one unit at a time from meta. Its total is the units to time
    at every micro-batch size, not the model's unit count (units that share a measurement
    are not timed): tqdm then shows how many are left and an ETA."""

    def __init__(self, bar: Any, sizes: int, label: str) -> None:
        self.bar = bar
        self.sizes = self.sizes_left = sizes
        self.label = label

    def expect(self, runs: int) -> None:
        """A micro-batch size starts with ``runs`` units to time: as many are expected at
        each later size until it starts."""
        self.bar.total = self.bar.n + runs * self.sizes_left
        self.sizes_left -= 1
        at = f" at each of {self.sizes} micro-batch sizes" if self.sizes > 1 else ""
        self.bar.set_description(
            f"{self.label}, {runs} to time{at}, one at a time from meta)", refresh=False
        )
        self.bar.refresh()

    def tick(self) -> None:
        """One more unit timed (past the expected count, the total follows)."""
        if self.bar.total is not None and self.bar.n >= self.bar.total:
            self.bar.total = self.bar.n + 1
        self.bar.update()


def _zero_grads(tensors: Sequence[torch.Tensor]) -> Callable[[], None]:
    def reset() -> None:
        for t in tensors:
            t.grad = None

    return reset


def _backward_from_ones() -> Callable[[Any], None]:
    """Backward of a unit's outputs with ones-like gradients, allocated once and reused
    (in a pipeline the gradients arrive from the next stage: not this unit's cost)."""
    cache: dict[int, list[torch.Tensor]] = {}

    def backward(out: Any) -> None:
        tensors = [t for t in float_tensor_leaves(out) if t.requires_grad]
        if not tensors:
            return
        key = len(tensors)
        grads = cache.get(key)
        if grads is None or any(g.shape != t.shape for g, t in zip(grads, tensors, strict=True)):
            grads = cache[key] = [torch.ones_like(t) for t in tensors]
        torch.autograd.backward(tensors, grads)

    return backward


def _node_bytes(
    ug: UnitGraph, flat_inputs: list[Any], flops: WeightMatmulCounter | None = None
) -> dict[str, list[tuple[tuple[str, int], int, int]]]:
    """Per graph node, ``(storage key, offset, bytes)`` of each tensor in its value, from one
    no-grad run of the unsplit graph. ``flops``: the same run also counts each unit's weight
    matmuls into it (the full batch's run: no forward of its own). O(nodes)."""
    info: dict[str, list[tuple[tuple[str, int], int, int]]] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if flops is not None:
                flops.at(ug.node_unit, n)
            out = super().run_node(n)
            info[n.name] = [
                (storage_key(t), int(t.storage_offset()), tensor_bytes(t))
                for t in tensor_leaves(out)
            ]
            return out

    with torch.no_grad(), flops if flops is not None else nullcontext():
        Recorder(ug.graph_module).run(*flat_inputs, enable_io_processing=False)
    return info


def _sum_unique(
    names: Sequence[str], info: dict[str, list[tuple[tuple[str, int], int, int]]]
) -> int:
    seen: set[tuple[tuple[str, int], int, int]] = set()
    total = 0
    for name in names:
        for item in info.get(name, []):
            if item not in seen:
                seen.add(item)
                total += item[2]
    return total


def _unit_outputs(ug: UnitGraph) -> list[list[str]]:
    """Per unit, the nodes it produces that a later unit or the model output consumes."""
    outs: list[list[str]] = [[] for _ in range(ug.num_units)]
    for node in ug.graph_module.graph.nodes:
        if node.op in ("output", "get_attr", "placeholder"):
            continue
        unit = ug.node_unit[node.name]
        if any(u.op == "output" or ug.node_unit[u.name] > unit for u in node.users):
            outs[unit].append(node.name)
    return outs


def _mutates_inputs(module: fx.GraphModule, args: tuple[Any, ...], flags: tuple[bool, ...]) -> bool:
    """Whether the unit writes into one of its activation inputs (checked on one no-grad run
    on copies, by the inputs' version counters)."""
    copies = tuple(
        a.detach().clone() if flag and isinstance(a, torch.Tensor) else a
        for a, flag in zip(args, flags, strict=True)
    )
    watched = [
        a for a, flag in zip(copies, flags, strict=True) if flag and isinstance(a, torch.Tensor)
    ]
    if not watched:
        return False
    before = [a._version for a in watched]
    with torch.no_grad():
        module(*copies)
    return before != [a._version for a in watched]


def _cuda_peak(fn: Callable[[], None], device: torch.device) -> int:
    """Bytes allocated at the peak of ``fn`` above what was allocated before it."""
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return max(torch.cuda.max_memory_allocated(device) - base, 0)


def compiled_module(module: nn.Module) -> Callable[..., Any]:
    """``module`` wrapped in ``torch.compile`` as a trainer compiling its stages does
    (default backend, fixed shapes: each micro-batch size is its own measurement). Lazy:
    the compile happens at the first call (untimed: capture pass and warm-up runs)."""
    # torch.compile looked up at call time: tests count the calls with a patched one.
    return torch.compile(module, dynamic=False)


def _unit_step(
    call: UnitCall,
    args: tuple[Any, ...],
    unit: _UnitMeasurement,
    device: torch.device,
    mutates: bool | None = None,
    run: Callable[..., Any] | None = None,
) -> TimedStep:
    """The timed step of one unit on its detached inputs ``args``; fills ``unit.peak_bytes``
    (``max_memory_allocated`` on CUDA, else saved + output + input-gradient bytes, so
    ``unit.activation_bytes`` and ``output_bytes`` must be set before on CPU). ``run``: what
    to call instead of ``call.module`` (its compiled module)."""
    leaves_needing_grad = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    params = [p for p in call.module.parameters() if p.requires_grad]
    params += [a for a in call.args if isinstance(a, nn.Parameter) and a.requires_grad]
    zero = _zero_grads([*leaves_needing_grad, *params])
    backward = _backward_from_ones()
    # Units that modify an input in place get a fresh copy of their activations per run.
    if mutates is None:
        mutates = _mutates_inputs(call.module, args, call.activation_args)
    state = {"args": args, "copy": mutates}
    if state["copy"]:
        state["args"] = fresh_inputs(args, call.activation_args)

    def forward(
        module: Callable[..., Any] = call.module if run is None else run, st: dict[str, Any] = state
    ) -> Any:
        return module(*st["args"])

    def reset(
        zero: Callable[[], None] = zero,
        st: dict[str, Any] = state,
        a: tuple[Any, ...] = args,
        flags: tuple[bool, ...] = call.activation_args,
    ) -> None:
        zero()
        if st["copy"]:
            st["args"] = fresh_inputs(a, flags)

    if device.type == "cuda":

        def forward_backward(f: Callable[[], Any] = forward, b: Any = backward) -> Any:
            return b(f())

        if run is not None:  # compiles the backward graph outside the peak measured
            forward_backward()
            reset()
        unit.peak_bytes = _cuda_peak(forward_backward, device)
        reset()
    else:
        # No allocator statistics on CPU: saved tensors + outputs + input gradients.
        grad_in = sum(tensor_bytes(a) for a in leaves_needing_grad)
        unit.peak_bytes = unit.activation_bytes + unit.output_bytes + grad_in
    return TimedStep(forward, backward, reset)


def _split_backward_step(
    call: UnitCall,
    args: tuple[Any, ...],
    unit: _UnitMeasurement,
    device: torch.device,
    clock: str | Callable[[], float],
    names: Mapping[int, str] | None = None,
) -> TimedStep | None:
    """A timed step whose backward runs the unit's backward as the zero-bubble schedules
    do, in two timed parts appended to ``unit.split_samples`` (seconds): B, the gradient of
    the unit's inputs (``autograd.grad`` with respect to them, keeping the graph), then W,
    the gradients of its parameters from where their paths meet the inputs' paths (torch's
    ``stage_backward_input`` / ``stage_backward_weight``, which the runtime runs). A unit
    whose inputs need no gradient is all W, one without parameters all B. A unit that uses
    a parameter more than once (one layer called several times), which torch's weight pass
    cannot take (:mod:`autopipe.profiler.weight_pass`), is not split: its first run sets
    ``unit.unsplit_reason`` and no sample is taken (its backward is then priced whole, as B).
    ``names``: ``id(parameter) -> name`` for that reason. None without
    ``torch.distributed`` (no split)."""
    try:
        from torch.distributed.pipelining._backward import (
            stage_backward_input,
            stage_backward_weight,
        )
    except ImportError:
        return None
    inputs, params, named = _split_operands(call, args, names)
    mutates = _mutates_inputs(call.module, args, call.activation_args)
    state = {"args": fresh_inputs(args, call.activation_args) if mutates else args}
    now = time.perf_counter if clock == CUDA_EVENTS else resolve_clock(clock)
    ones: dict[int, list[torch.Tensor]] = {}
    checked: list[bool] = []

    def forward(module: fx.GraphModule = call.module) -> list[torch.Tensor]:
        out = module(*state["args"])
        # Copies: B detaches what it differentiates in place, which a view (or a tensor the
        # unit saved for backward) must not see. Not timed: only B and W are kept.
        return [t.clone() for t in float_tensor_leaves(out) if t.requires_grad]

    def backward(outs: list[torch.Tensor]) -> None:
        if not outs:
            return
        grads = _ones_for(ones, outs)
        if not checked:
            checked.append(True)
            unit.unsplit_reason = reuse_reason(reused_parameters(outs, inputs, named))
        if unit.unsplit_reason:
            return  # torch's weight pass would fail: priced unsplit, nothing to time
        passes = (stage_backward_input, stage_backward_weight)
        unit.split_samples.append(
            _timed_split_backward(outs, grads, inputs, params, passes, device, now)
        )

    zero = _zero_grads([*inputs, *params])

    def reset() -> None:
        zero()
        if mutates:
            state["args"] = fresh_inputs(args, call.activation_args)

    return TimedStep(forward, backward, reset)


def _ones_for(ones: dict[int, list[torch.Tensor]], outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of ones for ``outs``, kept in ``ones`` by output count and made again only
    when a shape changes."""
    grads = ones.get(len(outs))
    if grads is None or any(g.shape != t.shape for g, t in zip(grads, outs, strict=True)):
        grads = ones[len(outs)] = [torch.ones_like(t) for t in outs]
    return grads


def _split_operands(
    call: UnitCall, args: tuple[Any, ...], names: Mapping[int, str] | None
) -> tuple[list[torch.Tensor], list[nn.Parameter], dict[str, nn.Parameter]]:
    """What the split backward differentiates: B's inputs (the arguments needing a gradient,
    not parameters), W's parameters, and the parameters by name (``names``, else
    ``"<unit index>:<k>"``)."""
    # Export graphs pass the unit's parameters as arguments: those are W's, not inputs.
    inputs = [
        a
        for a in args
        if isinstance(a, torch.Tensor) and a.requires_grad and not isinstance(a, nn.Parameter)
    ]
    params = [p for p in call.module.parameters() if p.requires_grad]
    params += [a for a in call.args if isinstance(a, nn.Parameter) and a.requires_grad]
    named = {(names or {}).get(id(p), f"{call.index}:{k}"): p for k, p in enumerate(params)}
    return inputs, params, named


def _timed_split_backward(
    outs: list[torch.Tensor],
    grads: list[torch.Tensor],
    inputs: list[torch.Tensor],
    params: Sequence[torch.Tensor],
    passes: tuple[Callable[..., Any], Callable[..., Any]],
    device: torch.device,
    now: Callable[[], float],
) -> tuple[float, float]:
    """(B, W) seconds of one split backward of ``outs`` (``passes``: torch's
    ``stage_backward_input`` and ``stage_backward_weight``), each between device
    synchronizations on ``device``, read on ``now``; no input gradient: all of it is W."""
    backward_input, backward_weight = passes
    synchronize(device)
    t0 = now()
    groups = None
    if inputs:
        _, groups = backward_input(outs, grads, inputs, iter(params))
    synchronize(device)
    t1 = now()
    if groups is not None and params:
        backward_weight(iter(params), groups)
    elif not inputs:
        torch.autograd.backward(outs, grads)  # no input gradient: all of it is W
    synchronize(device)
    return t1 - t0, now() - t1


def _split_medians(unit: _UnitMeasurement, warmup: int) -> None:
    """``unit``'s B and W: medians of its split samples after the warm-up runs."""
    kept = unit.split_samples[warmup:] or unit.split_samples
    if kept:
        unit.backward_input_s = statistics.median(b for b, _ in kept)
        unit.backward_weight_s = statistics.median(w for _, w in kept)


def _detached(value: Any) -> Any:
    """Tensors of ``value`` detached into leaves (floating ones keep ``requires_grad``)."""
    return map_tensors(
        lambda t: (
            t.detach().requires_grad_(t.requires_grad) if t.is_floating_point() else t.detach()
        ),
        value,
    )


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class _Capture:
    """One real forward through a model's per-unit split graph (:func:`run_units`) at one
    micro-batch size: each unit's inputs are recorded and the bytes it saves for backward
    counted per unit (``counter``). With ``one_at_a_time`` (a model on the meta device) each
    measured unit's weights are materialized when it runs, the unit is timed at once, alone,
    and its weights freed before the next unit runs. With ``compile`` each unit that runs
    runs its ``torch.compile``'d module (:func:`compiled_module`, one per unit, kept in
    ``compiled`` for its timed step): its saved bytes are what the compiled unit saves, and
    its forward compiles here, untimed."""

    def __init__(
        self,
        model: nn.Module,
        ug: UnitGraph,
        device: torch.device,
        share: bool,
        one_at_a_time: _Timing | None,
        split_clock: str | Callable[[], float] | None,
        compile: bool = False,
    ) -> None:
        self.split = split_units(ug, model)
        self.param_names = canonical_parameter_names(model)
        self.counter = SavedTensorCounter(exclude=parameter_storages(model))
        self.sharing = UnitSharing(self.split, enabled=share)
        self.units = [_UnitMeasurement() for _ in range(ug.num_units)]
        self.timed: dict[int, tuple[float, float]] = {}
        """Units timed while capturing (one at a time): (forward, backward) seconds."""
        self.mutates: dict[int, bool] = {}
        """Per unit from meta: whether it writes into one of its inputs."""
        self.device = device
        self.one_at_a_time = one_at_a_time
        self.split_clock = split_clock
        self.compile = compile
        self.compiled: dict[int, Callable[..., Any]] = {}
        """Per unit that ran (compile only), its compiled module."""
        self.materializer: Materializer | None = None
        self.state: list[list[torch.Tensor]] | None = None
        if one_at_a_time is not None:
            if one_at_a_time.expect is not None:
                one_at_a_time.expect(self.sharing.expected_runs(ug.num_units))
            # The split partitions run the traced graph module's tensors (see own_meta_state).
            self.materializer = Materializer(ug.graph_module, device, self.counter.exclude)
            self.state = unit_state(ug, ug.graph_module)

    def run(
        self, ug: UnitGraph, flat: list[Any], inputs: Any, loss_fn: LossFn | None
    ) -> tuple[Any, list[UnitCall]]:
        """The forward on ``flat`` (``inputs`` flattened) and the loss: the model's output
        and every unit's call. ProfilingError for an output the pipeline cannot join."""
        one_at_a_time = self.one_at_a_time is not None
        with self.counter.counting():
            flat_out, calls = run_units(
                self.split,
                flat,
                on_call=self.before,
                share=self.sharing,
                after=self.measure_now if one_at_a_time else None,
                inputs=self.writable if one_at_a_time else None,
                runner=self.runner if self.compile else None,
            )
            output = ug.unflatten_output(flat_out)
            try:  # refused here, at plan time, rather than by the runtime
                inputs_convention.check_joinable_output(output, _batch_size(inputs))
            except inputs_convention.OutputError as exc:
                raise ProfilingError(str(exc)) from None
            self.counter.tag = "loss"  # the loss is computed by the last stage
            _loss(output, inputs, loss_fn)
        return output, calls

    def before(self, index: int, _module: Any) -> None:
        """Unit ``index`` runs next: its saved tensors count for it (its weights exist)."""
        self.counter.tag = index
        if self.materializer is not None and self.state is not None:
            self.materializer.materialize(self.state[index])

    def runner(self, index: int, module: fx.GraphModule) -> Callable[..., Any]:
        """Unit ``index``'s compiled module, made on its first run (units sharing a
        measurement do not run, so identical units compile once)."""
        if index not in self.compiled:
            self.compiled[index] = compiled_module(module)
        return self.compiled[index]

    def writable(
        self, index: int, module: fx.GraphModule, args: tuple[Any, ...], flags: tuple[bool, ...]
    ) -> tuple[Any, ...]:
        """Unit ``index``'s inputs, copied when it writes into one of them."""
        # Units from meta get detached leaves as inputs; one that writes into its input
        # (ReLU(inplace=True)) needs copies, as autograd forbids writing into such leaves.
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            self.mutates[index] = _mutates_inputs(module, args, flags)
        return fresh_inputs(args, flags) if self.mutates[index] else args

    def measure_now(self, call: UnitCall) -> Any:
        """Time unit ``call`` alone while its weights exist (model on meta), then free them;
        returns its outputs, detached, for the next units."""
        timing = self.one_at_a_time
        assert self.materializer is not None and self.state is not None and timing is not None
        outputs = _detached(call.outputs)
        call.outputs = outputs
        unit = self.units[call.index]
        unit.activation_bytes = self.counter.bytes_by_tag.get(call.index, 0)
        # Timed runs must not count as the capture's saved tensors.
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            args = detach_args(call)
            step = _unit_step(
                call,
                args,
                unit,
                self.device,
                self.mutates.get(call.index),
                self.compiled.get(call.index),
            )
            step.samples_per_round = min(self.sharing.copies(call.index), SHARED_SAMPLES_CAP)
            steps = [step]
            split = None
            if self.split_clock is not None:
                split = _split_backward_step(
                    call, args, unit, self.device, self.split_clock, self.param_names
                )
                if split is not None:
                    split.samples_per_round = step.samples_per_round
                    steps.append(split)
            self.timed[call.index] = time_steps_interleaved(
                steps, self.device, warmup=timing.warmup, repeat=timing.repeat, clock=timing.clock
            )[0]
            _split_medians(unit, timing.warmup)
        # The steps hold the unit's parameters: drop them before the weights are freed.
        del step, steps, split, args
        self.compiled.pop(call.index, None)
        self.materializer.release(self.state[call.index])
        if timing.tick is not None:
            timing.tick()
        return outputs


def _prepare_size(
    model: nn.Module,
    ug: UnitGraph,
    inputs: Any,
    device: torch.device,
    loss_fn: LossFn | None,
    *,
    share: bool = True,
    info: dict[str, list[tuple[tuple[str, int], int, int]]] | None = None,
    one_at_a_time: _Timing | None = None,
    split_clock: str | Callable[[], float] | None = None,
    compile: bool = False,
) -> tuple[_SizeMeasurement, list[TimedStep]]:
    """Bytes per unit at the batch size of ``inputs`` and one timed step per measured unit
    (the loss is the last step; its time is added to the last unit).

    ``share``: units that are the same computation as an earlier one do not run; they share
    its measurement (:class:`~autopipe.profiler.sharing.UnitSharing`). ``info``: per-node
    bytes when already counted (on meta, or at the full batch with the weight matmuls' FLOPs);
    else one no-grad run counts them.
    ``one_at_a_time``: the model is on the meta device; each measured unit's weights are
    materialized, the unit is timed at once (alone) and its weights freed before the next
    unit runs, so only the loss step is returned. ``split_clock``: also time each measured
    unit's backward split into B and W (:func:`_split_backward_step`) on this clock; those
    steps come after the loss step (``split_of_step``). ``compile``: the units run and are
    timed ``torch.compile``'d (:class:`_Capture`).
    """
    flat = ug.flat_inputs(inputs)
    capture = _Capture(model, ug, device, share, one_at_a_time, split_clock, compile)
    units, counter = capture.units, capture.counter
    if info is None:
        info = _node_bytes(ug, flat)
    for i, names in enumerate(_unit_outputs(ug)):
        units[i].output_bytes = _sum_unique(names, info)
    output, calls = capture.run(ug, flat, inputs, loss_fn)
    same_as = list(range(ug.num_units))
    for c in calls:
        if c.same_as is not None:
            same_as[c.index] = c.same_as
    ran = [c for c in calls if c.same_as is None]
    for c in ran:
        units[c.index].activation_bytes = counter.bytes_by_tag.get(c.index, 0)
    # Keep only detached inputs so the forward's autograd graph is freed.
    isolated: list[tuple[UnitCall, tuple[Any, ...]]] = (
        [] if one_at_a_time is not None else [(c, detach_args(c)) for c in ran]
    )
    detached_output = _detached(output)
    del output, calls, ran
    input_names = [nd.name for nd in ug.graph_module.graph.nodes if nd.op == "placeholder"]
    measurement = _SizeMeasurement(
        units=units,
        cut_bytes=[_sum_unique(names, info) for names in cut_tensors(ug)],
        input_bytes=_sum_unique(input_names, info),
    )
    steps, measurement.split_of_step = _size_steps(
        isolated, capture, same_as, _loss_step(detached_output, inputs, loss_fn)
    )
    measurement.unit_of_step = [c.index for c, _ in isolated]
    measurement.same_as = same_as
    measurement.timed = capture.timed
    measurement.loss_activation_bytes = counter.bytes_by_tag.get("loss", 0)
    measurement.peak_estimated = device.type != "cuda"
    if capture.materializer is not None:
        measurement.materialized_peak_bytes = capture.materializer.peak_bytes
    return measurement, steps


def _loss_step(output: Any, inputs: Any, loss_fn: LossFn | None) -> TimedStep:
    """The loss on the (detached) model ``output`` as a timed step: forward and backward."""
    out_leaves = [t for t in tensor_leaves(output) if t.requires_grad]
    return TimedStep(
        lambda: _loss(output, inputs, loss_fn),
        lambda loss: loss.backward(),
        _zero_grads(out_leaves),
    )


def _size_steps(
    isolated: list[tuple[UnitCall, tuple[Any, ...]]],
    capture: _Capture,
    same_as: list[int],
    loss_step: TimedStep,
) -> tuple[list[TimedStep], list[int]]:
    """The timed steps of one micro-batch size, in order: each measured unit on its detached
    inputs (``isolated``), the loss, then (with a split clock) each unit's split backward.
    A unit that ``k`` units share is timed ``min(k, SHARED_SAMPLES_CAP)`` times per round.
    Returns the steps and the unit of each split-backward step."""
    copies = Counter(same_as)
    steps: list[TimedStep] = []
    for call, args in isolated:
        step = _unit_step(
            call,
            args,
            capture.units[call.index],
            capture.device,
            run=capture.compiled.get(call.index),
        )
        step.samples_per_round = min(copies[call.index], SHARED_SAMPLES_CAP)
        steps.append(step)
    steps.append(loss_step)
    split_of_step: list[int] = []
    if capture.split_clock is None:
        return steps, split_of_step
    for call, args in isolated:
        split_step = _split_backward_step(
            call,
            args,
            capture.units[call.index],
            capture.device,
            capture.split_clock,
            capture.param_names,
        )
        if split_step is not None:
            split_step.samples_per_round = min(copies[call.index], SHARED_SAMPLES_CAP)
            steps.append(split_step)
            split_of_step.append(call.index)
    return steps, split_of_step


def _record_times(m: _SizeMeasurement, times: list[tuple[float, float]], warmup: int) -> None:
    """Put the timed steps (units, then the loss, then the split backwards) into the per-unit
    figures: a unit sharing another's measurement gets its times and saved bytes; the loss's
    time and saved bytes go to the last unit, where a pipeline computes the loss (its
    backward is part of that unit's B, the pass that starts from the loss)."""
    timed = dict(m.timed)
    timed.update(zip(m.unit_of_step, times, strict=False))
    for i in m.split_of_step:
        _split_medians(m.units[i], warmup)
    for i, unit in enumerate(m.units):
        rep = m.units[m.same_as[i]]
        unit.forward_s, unit.backward_s = timed[m.same_as[i]]
        if m.same_as[i] != i:
            unit.activation_bytes = rep.activation_bytes
            unit.peak_bytes = rep.peak_bytes
            unit.backward_input_s = rep.backward_input_s
            unit.backward_weight_s = rep.backward_weight_s
            unit.unsplit_reason = rep.unsplit_reason
        if unit.unsplit_reason:
            # Run unsplit, B does the whole backward and W nothing (W folded into B).
            unit.backward_input_s, unit.backward_weight_s = unit.backward_s, 0.0
    m.loss_forward_s, m.loss_backward_s = times[len(m.unit_of_step)]
    m.units[-1].forward_s += m.loss_forward_s
    m.units[-1].backward_s += m.loss_backward_s
    if m.units[-1].backward_input_s + m.units[-1].backward_weight_s > 0:
        m.units[-1].backward_input_s += m.loss_backward_s
    m.units[-1].activation_bytes += m.loss_activation_bytes
    if m.peak_estimated:
        m.units[-1].peak_bytes += m.loss_activation_bytes


def whole_model_saved_bytes(
    model: nn.Module, inputs: Any, loss_fn: LossFn | None, run: Callable[..., Any] | None = None
) -> int:
    """Bytes the whole model's forward + loss saves for backward, in one real run (of
    ``run``, the model's compiled module, when given).

    The same count as the units' (each storage once, parameters and buffers left out).
    """
    counter = SavedTensorCounter(exclude=parameter_storages(model))
    with counter.counting():
        _loss(call_model(model if run is None else run, inputs), inputs, loss_fn)
    return counter.total_bytes


def whole_model_step(
    model: nn.Module, inputs: Any, loss_fn: LossFn | None, compile: bool = False
) -> tuple[TimedStep, int]:
    """The whole model in one piece as a timed step (forward + loss, backward) and the bytes
    it saves for backward (``whole_model_saved_bytes``); ``compile``: the model
    ``torch.compile``'d, as its units were (its forward compiles in the byte count)."""
    params = [p for p in model.parameters() if p.requires_grad]
    run = compiled_module(model) if compile else model
    step = TimedStep(
        lambda: _loss(call_model(run, inputs), inputs, loss_fn),
        lambda loss: loss.backward(),
        _zero_grads(params),
    )
    return step, whole_model_saved_bytes(model, inputs, loss_fn, run if compile else None)


# ---------------------------------------------------------------------------------------
# Assembling the Profile


def nonlinear_bytes(
    unit_names: list[str],
    sizes: list[int],
    measured: list[_SizeMeasurement],
    tolerance: float = 0.1,
    resident_bytes: int = 0,
) -> list[str]:
    """Where linear extrapolation of saved-activation and output bytes from the full batch
    to a smaller micro-batch size is off by more than ``tolerance`` of the memory those
    bytes are part of: the model's activation and output bytes at that size plus
    ``resident_bytes`` (its parameters, held whatever the batch); names the units that err
    most. Batch-independent tensors (position embeddings, masks, T5's relative position
    bias of shape (1, heads, q, k) that its first block computes and hands to every later
    one) are extrapolated as if they held samples; they stay silent unless the error they
    make is material to that memory."""
    big_b, base = sizes[0], measured[0]
    offenders: list[str] = []
    for size, m in zip(sizes[1:], measured[1:], strict=True):
        rows = []
        for kind in ("activation_bytes", "output_bytes"):
            for name, ub, us in zip(unit_names, base.units, m.units, strict=True):
                expected = getattr(ub, kind) * size / big_b
                got = getattr(us, kind)
                rows.append((abs(got - expected), name, kind, got, expected))
        total_expected = sum(r[4] for r in rows) + resident_bytes
        if sum(r[0] for r in rows) <= tolerance * total_expected:
            continue
        for _, name, kind, got, expected in sorted(rows, reverse=True)[:3]:
            offenders.append(f"{name} {kind} {got} B at b={size}, {expected:.0f} B expected")
    return offenders


def profile(
    model: nn.Module,
    example_inputs: Any,
    options: MeasureOptions | None = None,
    *,
    loss_fn: LossFn | None = None,
    progress: bool = True,
    cache: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    tp_plan: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None,
) -> Profile:
    """Measure per-unit forward/backward seconds and memory of one training step.

    ``example_inputs``: a tensor (one positional argument), a tuple (positional arguments)
    or a dict (keyword arguments); dim 0 of the tensors is the batch (size ``B``).
    ``device``/``dtype``: the model and floating inputs are moved/cast **in place** (default:
    where the model is, in its dtype). ``loss_fn(output, inputs)`` drives backward (default:
    :func:`autopipe.profiler.objective.default_loss`). ``microbatch_sizes``: batch sizes to time for the
    ``t(b) = a + c * b`` fit; ``None`` = ``B`` and ``B/4`` (or ``B/2``); ``()`` = ``B`` only.
    ``cache=True`` reuses a profile saved for the same model structure, inputs, device,
    dtype and options (``cache_dir`` or ``$AUTOPIPE_CACHE_DIR`` or ``~/.cache/autopipe``),
    and says so on the ``autopipe`` logger (INFO: "profile read from cache (PATH)");
    ``cache=False`` (the CLI's ``--no-cache``) measures again.
    ``threads``: torch's intra-op thread count while measuring. ``None`` means 1 on CPU
    (single-thread timings are stable on a loaded host and keep the units' shares right;
    oversubscribed multi-thread kernels are not) and unchanged on GPUs. ``clock``:
    ``"wall"``, ``"thread_cpu"`` (CPU time of the measuring thread, robust to other processes
    on a shared host), ``"cuda_events"`` (CUDA events: device time), ``"auto"``
    (``"thread_cpu"`` for single-threaded CPU runs, CUDA events on CUDA, else wall) or a
    function returning seconds (a fake clock for tests).
    ``tp_plan``: the model's tensor-parallel plan or a function returning it (a model file's
    ``tp_plan``); None: the model's own (Hugging Face's), else none; the profile's TP fields
    come from it (:mod:`autopipe.profiler.tensor_parallel`).
    ``optimizer`` / ``bytes_per_parameter``: the training state per parameter that the units'
    ``gradient_bytes`` and ``optimizer_bytes`` count (``auto``: mixed-precision Adam for
    16-bit parameters, Adam for fp32; see ``autopipe/core/optimizer.py``).

    ``share=True``: units that are the same computation (same graph, parameter shapes and
    input shapes: :mod:`autopipe.profiler.signature`) are measured once, on the first of them,
    and share its figures (``UnitProfile.measured_as`` names it); that unit is timed up to
    ``SHARED_SAMPLES_CAP`` times per round. ``reference``: also time the whole model in one
    piece (``total_forward_s`` ...), the check the units must add up to; ``None`` does so
    only when no unit shares a measurement (otherwise the reference would cost more than all
    the units together). ``meta_init``: the model is on the meta device (``None``: detected)
    and larger than the device may hold: each measured unit's weights are materialized on
    ``device`` (default CPU) just for its measurement (``profiler/materialize.py``), so peak
    memory is one unit plus activations; no reference is timed.
    ``scale_to_reference``: time the whole model too (``reference``) and scale every unit's times so
    they add up to it (factors in ``meta["reference_scale"]``).
    ``units``: fnmatch patterns over module paths naming the units (``"model.layers.*"``)
    instead of ``granularity``'s choice.
    Train/eval flags, buffers, ``.grad`` and the global RNG are restored afterwards.

    ``options`` (:class:`autopipe.profiler.options.MeasureOptions`, default
    ``MeasureOptions()``) carry every setting above but ``loss_fn``, ``progress``, ``cache``,
    ``cache_dir`` and ``tp_plan``; the resolved options are the cache key.

    Returns a :class:`Profile` whose times are seconds per call at batch ``B`` and sizes bytes
    at batch ``B``. Raises ``TraceError`` if the model cannot be traced.
    """
    if options is not None and not isinstance(options, MeasureOptions):
        # The device was this argument until profile took MeasureOptions only.
        raise UsageError(
            f"profile: options must be an autopipe.MeasureOptions, got {options!r}; "
            f"a device goes in autopipe.MeasureOptions(device=...)"
        )
    setup = _setup(model, example_inputs, options or MeasureOptions())
    key, cached = _read_cache(model, setup, loss_fn, cache_dir) if cache else (None, None)
    if cached is not None:
        annotate_tensor_parallel(cached, model, tp_plan)
        return annotate_context_expert(cached, model, example_inputs)
    with _preserved(model, setup.device), num_threads(setup.threads):
        run = _measure_sizes(model, setup, loss_fn, progress)
    return _finish(
        _assemble(model, setup, run),
        key,
        cache_dir,
        lambda p: annotate_context_expert(
            annotate_tensor_parallel(p, model, tp_plan), model, example_inputs
        ),
    )


def _read_cache(
    model: nn.Module,
    setup: _Setup,
    loss_fn: LossFn | None,
    cache_dir: str | os.PathLike[str] | None,
) -> tuple[str, Profile | None]:
    """The measurement's cache key and the profile saved under it (None when there is none);
    a profile read is said on the ``autopipe`` logger."""
    key = _cache_key(model, setup, loss_fn)
    cached = load_cached(key, cache_dir)
    if cached is not None:
        # Said, not silent: a user who changed something the key does not see (the
        # machine's load, a driver) must know nothing was measured, and how to measure.
        log.info(
            "profile read from cache (%s); --no-cache re-measures",
            cache_path(key, cache_dir),
        )
    return key, cached


@dataclass
class _Setup:
    """The measurement as resolved on this machine, before anything is traced."""

    opts: MeasureOptions
    device: torch.device
    dtype: torch.dtype
    meta_init: bool
    reference: bool | None
    """Time the whole model too (``None``: when no unit shares a measurement)."""
    threads: int | None
    clock: str | Callable[[], float]
    clock_name: str
    optimizer: str
    """Resolved (``auto`` chosen by the dtype's element size)."""
    optimizer_chosen: bool
    inputs: Any
    """The example inputs on ``device``, floating ones in ``dtype``."""
    batch_size: int
    sizes: list[int]
    """The micro-batch sizes to time, ``batch_size`` first."""


def _setup(model: nn.Module, example_inputs: Any, opts: MeasureOptions) -> _Setup:
    """Check ``opts`` against the model, move and cast the model (in place) and the inputs,
    and resolve device, dtype, optimizer, sizes, threads and clock. ValueError for options
    that contradict each other or the model."""
    optimizer = normalize_optimizer(opts.optimizer)  # a typo fails now, not after measuring
    meta_init, reference = _meta_and_reference(model, opts)
    dev = torch.device(opts.device) if opts.device is not None else None
    if dev is None:
        dev = torch.device("cpu") if meta_init else resolve_device(model, None)
    if dev.type == "meta":
        raise ValueError("device='meta' holds no data: measure on 'cpu' or 'cuda'")
    dt = resolve_dtype(model, opts.dtype)
    if not meta_init:
        model.to(device=dev)
    if opts.dtype is not None:
        model.to(dtype=dt)
    element_bytes = torch.tensor([], dtype=dt).element_size()
    resolved_optimizer = resolve_optimizer(optimizer, element_bytes)
    inputs = move_inputs(example_inputs, dev, dt)
    big_b = _batch_size(inputs)
    sizes = microbatch_sizes_to_profile(big_b, opts.microbatch_sizes)
    threads = opts.threads
    if threads is None and dev.type == "cpu":
        threads = 1
    clock = opts.clock
    if clock == "auto":
        single = (threads or torch.get_num_threads()) == 1
        clock = "thread_cpu" if dev.type == "cpu" and single else "wall"
        if dev.type == "cuda":
            clock = CUDA_EVENTS
    return _Setup(
        opts=opts,
        device=dev,
        dtype=dt,
        meta_init=meta_init,
        reference=reference,
        threads=threads,
        clock=clock,
        clock_name=clock if isinstance(clock, str) else getattr(clock, "__name__", "custom"),
        optimizer=resolved_optimizer,
        optimizer_chosen=optimizer != "auto",
        inputs=inputs,
        batch_size=big_b,
        sizes=sizes,
    )


def _meta_and_reference(model: nn.Module, opts: MeasureOptions) -> tuple[bool, bool | None]:
    """Whether to measure from meta (``opts.meta_init``, ``None``: when the model is on
    meta) and whether to time the whole model (``opts.reference``; forced by
    ``scale_to_reference``). ValueError when they contradict each other or the model."""
    meta_init, reference = opts.meta_init, opts.reference
    is_meta = on_meta(model)
    if meta_init is None:
        meta_init = is_meta
    elif meta_init and not is_meta:
        raise ValueError(
            "meta_init=True needs the model built on the meta device: "
            "with torch.device('meta'): model = build()"
        )
    elif is_meta and not meta_init:
        raise ValueError("the model is on the meta device: pass meta_init=True (or None)")
    if opts.scale_to_reference:
        if reference is False:
            raise ValueError(
                "scale_to_reference=True times the whole model: it needs reference=True"
            )
        reference = True
    if meta_init and reference:
        raise ValueError(
            "reference=True needs the whole model in memory (so does scale_to_reference=True); "
            "not with meta_init"
        )
    return meta_init, reference


def _cache_key(model: nn.Module, setup: _Setup, loss_fn: LossFn | None) -> str:
    """The profile cache's key: the options as resolved on this machine, so the same
    measurement asked twice, or asked with a device/clock "auto" resolves to, finds one
    entry."""
    resolved = dataclasses.replace(
        setup.opts,
        device=str(setup.device),
        dtype=str(setup.dtype).removeprefix("torch."),
        microbatch_sizes=tuple(setup.sizes),
        threads=setup.threads,
        clock=setup.clock_name,
        meta_init=setup.meta_init,
        split_backward=setup.opts.times_split_backward,
    )
    return cache_key(
        model,
        setup.inputs,
        **resolved.key(),
        loss_fn=getattr(loss_fn, "__qualname__", repr(loss_fn)),
    )


@dataclass
class _Measured:
    """Every micro-batch size measured: the per-size figures and the whole-model reference."""

    ug: UnitGraph
    """The units, traced at the full batch."""
    sizes: list[int]
    """The micro-batch sizes measured (a size whose units differ is skipped)."""
    measured: list[_SizeMeasurement]
    total_forward_s: float = 0.0
    total_backward_s: float = 0.0
    total_saved_bytes: int = 0
    timed_reference: bool = False
    parameters: list[dict[str, Any]] = field(default_factory=list)
    """Per unit, its parameter and training-state fields of :class:`UnitProfile`."""
    parameter_bytes_total: int = 0
    linear_flops: list[float] = field(default_factory=list)
    """Per unit, its weight matmuls' forward FLOPs at the full batch
    (``UnitProfile.linear_forward_flops``)."""


def _measure_sizes(
    model: nn.Module, setup: _Setup, loss_fn: LossFn | None, progress: bool
) -> _Measured:
    """Trace the model, then measure every micro-batch size (all in the same rounds; from
    meta one size after another, each unit timed alone) and count the parameters."""
    opts, meta_init = setup.opts, setup.meta_init
    # On meta, trace a copy (no data to copy): tracers may keep weak references to the
    # tensors they saw, and those tensors could then not be materialized in place.
    traced_model = copy.deepcopy(model) if meta_init else model
    trace_inputs = to_meta(setup.inputs) if meta_init else setup.inputs
    ug = trace_units(traced_model, trace_inputs, opts.granularity, opts.tracer, list(opts.units))
    label = f"profiling {type(model).__name__} ({ug.num_units} units"
    bar = tqdm.auto.tqdm(  # looked up when called: tests record the bar
        total=opts.warmup + opts.repeat if not meta_init else None,
        desc=label + (", one at a time from meta)" if meta_init else ")"),
        unit="round" if not meta_init else "unit",
        disable=not progress,
        leave=False,
    )
    graphs = _size_graphs(traced_model, ug, setup)
    infos: list[Any] = [None] * len(graphs)
    if meta_init:
        infos, linear_flops = _meta_node_bytes(graphs, setup.device, setup.batch_size)
    else:  # the full batch's no-grad run counting bytes counts the weight matmuls too
        full = next(i for i, (size, _, _) in enumerate(graphs) if size == setup.batch_size)
        _, full_inputs, full_ug = graphs[full]
        counter = WeightMatmulCounter(
            full_ug.num_units, parameter_storage_keys(model, full_ug.graph_module)
        )
        infos[full] = _node_bytes(full_ug, full_ug.flat_inputs(full_inputs), counter)
        linear_flops = counter.flops
    units_bar = _UnitsProgress(bar, len(graphs), label)
    one_at_a_time = (
        _Timing(opts.warmup, opts.repeat, setup.clock, tick=units_bar.tick, expect=units_bar.expect)
        if meta_init
        else None
    )
    run = _Measured(ug=ug, sizes=[], measured=[], linear_flops=linear_flops)
    prepared = [
        _prepare_timed_size(model, setup, loss_fn, graph, info, one_at_a_time, bar, run)
        for graph, info in zip(graphs, infos, strict=True)
    ]
    size_times = _time_sizes([steps for _, _, steps, _ in prepared], setup, bar)
    for (size, m, _, with_whole), times in zip(prepared, size_times, strict=True):
        if with_whole:
            run.total_forward_s, run.total_backward_s = times.pop()
        _record_times(m, times, opts.warmup)
        run.measured.append(m)
        run.sizes.append(size)
    bar.close()
    run.parameters, run.parameter_bytes_total = parameter_accounting(
        ug, model, setup.optimizer, opts.bytes_per_parameter
    )
    return run


def _prepare_timed_size(
    model: nn.Module,
    setup: _Setup,
    loss_fn: LossFn | None,
    graph: tuple[int, Any, UnitGraph],
    info: Any,
    one_at_a_time: _Timing | None,
    bar: Any,
    run: _Measured,
) -> tuple[int, _SizeMeasurement, list[TimedStep], bool]:
    """One micro-batch size's measurement and timed steps (:func:`_prepare_size`), with the
    whole model's step appended (its saved bytes in ``run``) when the reference is timed at
    this size: (size, measurement, steps, whether the whole model's step is the last)."""
    opts = setup.opts
    size, size_inputs, size_ug = graph
    bar.set_postfix_str(f"micro-batch {size}")
    m, steps = _prepare_size(
        model,
        size_ug,
        size_inputs,
        setup.device,
        loss_fn,
        share=opts.share,
        info=info,
        one_at_a_time=one_at_a_time,
        # B and W at every size: W's per-call part (one autograd call per
        # parameter group) is larger than the whole backward's. Not compiled: torch runs
        # no compiled stage split (autopipe/core/schedule_rules.py).
        split_clock=setup.clock if opts.times_split_backward else None,
        compile=opts.compile,
    )
    shared = any(rep != i for i, rep in enumerate(m.same_as))
    with_whole = size == setup.batch_size and (
        setup.reference or (setup.reference is None and not shared and not setup.meta_init)
    )
    if with_whole:
        # The whole model is timed in the same rounds as its units.
        whole, run.total_saved_bytes = whole_model_step(
            model, setup.inputs, loss_fn, compile=opts.compile
        )
        steps.append(whole)
        run.timed_reference = True
    return size, m, steps, with_whole


def _size_graphs(
    traced_model: nn.Module, ug: UnitGraph, setup: _Setup
) -> list[tuple[int, Any, UnitGraph]]:
    """Per micro-batch size: its inputs (the first rows of the batch) and its unit graph,
    ``ug`` itself unless its tracer fixed the batch size (export specialised it, or hooks
    recorded one run's chain: then traced again at that size with the same tracer; a size
    whose units differ is skipped with a warning)."""
    opts, big_b = setup.opts, setup.batch_size
    graphs: list[tuple[int, Any, UnitGraph]] = []
    for size in setup.sizes:
        size_inputs = setup.inputs if size == big_b else slice_batch(setup.inputs, size, big_b)
        size_ug = ug
        if size != big_b and not batch_is_dynamic(ug.graph_module, size):
            # export specialised the batch dimension, or took this size for a constant (0 and
            # 1 rows), or hooks saw one run's chain: trace again at this batch size.
            traced = to_meta(size_inputs) if setup.meta_init else size_inputs
            size_ug = trace_units(
                traced_model, traced, opts.granularity, ug.tracer, list(opts.units)
            )
            if size_ug.unit_names != ug.unit_names:
                warnings.warn(
                    f"units differ at micro-batch size {size}; size skipped", stacklevel=4
                )
                continue
        graphs.append((size, size_inputs, size_ug))
    return graphs


def _meta_node_bytes(
    graphs: list[tuple[int, Any, UnitGraph]], device: torch.device, batch_size: int
) -> tuple[list[dict[str, list[tuple[tuple[str, int], int, int]]]], list[float]]:
    """Per micro-batch size (model on meta), the bytes of every graph value from a run on
    meta, before the graphs are pointed at the real ``device`` (export bakes the tracing
    device into some ops); then the graphs own their meta state and run on ``device``.
    Also, per unit, the weight matmuls' forward FLOPs at ``batch_size``, counted in the full
    batch's run on meta (:class:`~autopipe.profiler.opcount.WeightMatmulCounter`)."""
    for _, _, size_ug in graphs:
        own_meta_state(size_ug.graph_module)
    full_ug = next(size_ug for size, _, size_ug in graphs if size == batch_size)
    counter = WeightMatmulCounter(full_ug.num_units, parameter_storage_keys(full_ug.graph_module))
    # the sizes may share one graph (a batch-dynamic trace): count at the full batch's size
    infos = [
        meta_node_bytes(
            size_ug,
            size_ug.flat_inputs(to_meta(size_inputs)),
            counter if size == batch_size else None,
        )
        for size, size_inputs, size_ug in graphs
    ]
    for _, _, size_ug in graphs:
        retarget_devices([size_ug.graph_module], device)
    return infos, counter.flops


def _time_sizes(
    size_steps: list[list[TimedStep]], setup: _Setup, bar: Any
) -> list[list[tuple[float, float]]]:
    """(forward, backward) seconds of every step, per micro-batch size."""
    opts = setup.opts
    if setup.meta_init:  # one size after another: each holds only its own materialized units
        return [
            time_steps_interleaved(
                steps, setup.device, warmup=opts.warmup, repeat=opts.repeat, clock=setup.clock
            )
            for steps in size_steps
        ]
    # Every size in the same rounds: a drift of the machine's speed then hits all sizes
    # alike, and the per-call parts fitted across sizes do not take it for a difference
    # between sizes.
    flat = time_steps_interleaved(
        [step for steps in size_steps for step in steps],
        setup.device,
        warmup=opts.warmup,
        repeat=opts.repeat,
        tick=lambda: bar.update(),
        clock=setup.clock,
    )
    size_times, start = [], 0
    for steps in size_steps:
        size_times.append(flat[start : start + len(steps)])
        start += len(steps)
    return size_times


def _assemble(model: nn.Module, setup: _Setup, run: _Measured) -> Profile:
    """The Profile from the measured sizes: the full batch's figures, per-call parts fitted
    across sizes, the measurement's settings in ``meta`` (warns when bytes do not scale
    linearly with the micro-batch size)."""
    ug, measured, sizes, opts = run.ug, run.measured, run.sizes, setup.opts
    offenders = (
        nonlinear_bytes(ug.unit_names, sizes, measured, resident_bytes=run.parameter_bytes_total)
        if len(measured) > 1
        else []
    )
    if offenders:
        warnings.warn(
            "bytes do not scale linearly with micro-batch size: "
            + "; ".join(offenders[:4])
            + "; memory at other micro-batch sizes is extrapolated linearly and may be off",
            stacklevel=3,
        )
    base = measured[0]
    units = _unit_profiles(ug, run)
    scale = (
        _scale_to_reference(units, run.total_forward_s, run.total_backward_s)
        if opts.scale_to_reference
        else None
    )
    meta: dict[str, Any] = {
        "microbatch_sizes": sizes,
        "loss_forward_s": base.loss_forward_s,
        "loss_backward_s": base.loss_backward_s,
        "warmup": opts.warmup,
        "repeat": opts.repeat,
        "threads": torch.get_num_threads() if setup.threads is None else setup.threads,
        "clock": setup.clock_name,
        "host": platform.node(),
        "reference": run.timed_reference,
        "shared_samples_cap": SHARED_SAMPLES_CAP if opts.share else 1,
        "meta_init": setup.meta_init,
        "compile": opts.compile,
        "materialized_peak_bytes": max(m.materialized_peak_bytes for m in measured),
        "per_size": [
            {
                "microbatch_size": s,
                "forward_s": [u.forward_s for u in m.units],
                "backward_s": [u.backward_s for u in m.units],
                "activation_bytes": [u.activation_bytes for u in m.units],
            }
            for s, m in zip(sizes, measured, strict=True)
        ],
    }
    if scale is not None:
        meta["reference_scale"] = scale
    return Profile(
        **profile_header(ug, setup.dtype, type(model).__name__),
        units=units,
        cut_bytes=base.cut_bytes,
        batch_size=setup.batch_size,
        device=str(setup.device),
        mode="measured",
        input_bytes=base.input_bytes,
        total_forward_s=run.total_forward_s,
        total_backward_s=run.total_backward_s,
        total_activation_bytes=run.total_saved_bytes,
        parameter_bytes_total=run.parameter_bytes_total,
        optimizer=setup.optimizer,
        optimizer_chosen=setup.optimizer_chosen or opts.bytes_per_parameter is not None,
        state_bytes_per_parameter=opts.bytes_per_parameter or 0.0,
        meta=meta,
    )


def _unit_profiles(ug: UnitGraph, run: _Measured) -> list[UnitProfile]:
    """Each unit's figures at the full batch, with per-call parts (seconds) fitted across
    the sizes (``t(b) = a + c * b``, at most the time itself; 0 with one size). A unit
    shares a measurement when it did at every size."""
    measured, sizes = run.measured, run.sizes
    base = measured[0]
    several = len(measured) > 1
    units: list[UnitProfile] = []
    for i, name in enumerate(ug.unit_names):
        um = base.units[i]
        rep = base.same_as[i]
        shares = rep != i and all(m.same_as[i] == rep for m in measured)
        fwd_a, _ = fit_time_model(sizes, [m.units[i].forward_s for m in measured])
        bwd_a, _ = fit_time_model(sizes, [m.units[i].backward_s for m in measured])
        bi_a, _ = fit_time_model(sizes, [m.units[i].backward_input_s for m in measured])
        bw_a, _ = fit_time_model(sizes, [m.units[i].backward_weight_s for m in measured])
        split_fit = several and um.backward_input_s + um.backward_weight_s > 0
        units.append(
            UnitProfile(
                name=name,
                kind=ug.unit_kinds[i],
                forward_s=um.forward_s,
                backward_s=um.backward_s,
                forward_overhead_s=min(fwd_a, um.forward_s) if several else 0.0,
                backward_overhead_s=min(bwd_a, um.backward_s) if several else 0.0,
                backward_input_s=um.backward_input_s,
                backward_weight_s=um.backward_weight_s,
                backward_input_overhead_s=min(bi_a, um.backward_input_s) if split_fit else 0.0,
                backward_weight_overhead_s=min(bw_a, um.backward_weight_s) if split_fit else 0.0,
                activation_bytes=um.activation_bytes,
                output_bytes=um.output_bytes,
                peak_bytes=um.peak_bytes,
                measured_as=ug.unit_names[rep] if shares else "",
                backward_unsplit=um.unsplit_reason,
                linear_forward_flops=run.linear_flops[i] if run.linear_flops else 0.0,
                **run.parameters[i],
            )
        )
    return units


def _scale_to_reference(
    units: list[UnitProfile], total_forward_s: float, total_backward_s: float
) -> dict[str, float]:
    """Scale the units' forward times (per-call parts included) by the whole model's forward
    over their sum, and their backward times (B, W and per-call parts included) likewise, in
    place; returns the two factors. O(N)."""
    fwd = sum(u.forward_s for u in units)
    bwd = sum(u.backward_s for u in units)
    f = total_forward_s / fwd if fwd > 0 and total_forward_s > 0 else 1.0
    b = total_backward_s / bwd if bwd > 0 and total_backward_s > 0 else 1.0
    for u in units:
        u.forward_s *= f
        u.forward_overhead_s *= f
        u.backward_s *= b
        u.backward_overhead_s *= b
        u.backward_input_s *= b
        u.backward_weight_s *= b
        u.backward_input_overhead_s *= b
        u.backward_weight_overhead_s *= b
    return {"forward": f, "backward": b}


def _finish(
    profile: Profile,
    key: str | None,
    cache_dir: str | os.PathLike[str] | None,
    annotate: Callable[[Profile], Profile],
) -> Profile:
    annotate(profile)  # the TP fields: from the model's plan, not measured
    if key is not None:
        save_cached(profile, key, cache_dir)
    return profile
