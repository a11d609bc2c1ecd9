"""Analytic profiles: per-unit costs counted on the meta device, priced for a DeviceSpec.

Nothing runs on real data and no weights are allocated: the model is built (or moved)
onto the ``meta`` device, one forward and one backward pass run there, and every aten
op is priced with a roofline (:mod:`autopipe.profiler.opcount`):

    t(op) = max(flops / (peak[dtype] x compute_eff), bytes / (bandwidth x memory_eff))
    t(unit, phase) = sum of t(op) over the unit's ops + kernels x launch_overhead

``forward_overhead_s``/``backward_overhead_s`` are the launch overheads, the part of
a micro-batch that does not shrink with its size. Memory per unit comes from the meta
tensors' shapes and dtypes with the measured profiler's conventions (so the two agree
field by field): parameters and buffers each unit uses (a tied weight counts in every
unit using it, once in ``parameter_bytes_total``), gradients, optimizer state, tensors
saved for backward (``saved_tensors_hooks``, deduplicated by storage, parameters and
buffers excluded), outputs handed to later units, cut bytes, and
``peak_bytes = saved + outputs + gradients of the unit's inputs``.

Units come from ``autopipe.profiler.units.trace_units`` (fx, then export, then hooks).
The traced graph runs node by node; each node makes its unit current, and every autograd
node created meanwhile gets a pre-hook that makes that unit current again in backward.
The loss runs after the last unit and is booked to it. Cost is O(#ops) with small
constants: the 5.75 B-parameter GPT (48 blocks, seq 2048) profiles in 1-3 s here, every
block counted (no shortcut through repeated blocks).

``F.scaled_dot_product_attention`` is routed to the fused (flash) attention op on meta,
as the CPU and CUDA backends do, so attention memory is O(seq), not O(seq^2); where the
fused op does not apply (dropout, grouped-query heads, a value head size unlike the query's)
torch's dispatch is used, and where that cannot run on meta, the math decomposition
(``softmax(q k^T) v``). Models with data-dependent control flow cannot run on meta and are
rejected with a clear error; an op that fails on meta is one ``AnalyticProfileError``
naming analytic mode, the unit and the phase.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from autopipe.profiler import objective
from autopipe.profiler.calibrate import apply_times as _apply_times
from autopipe.profiler.calibrate import priced_times
from autopipe.profiler.context_expert import annotate_context_expert
from autopipe.profiler.header import profile_header
from autopipe.profiler.inputs import OutputError, batch_size_of, check_joinable_output
from autopipe.profiler.measure import microbatch_sizes_to_profile, slice_batch
from autopipe.profiler.memory import parameter_accounting
from autopipe.profiler.opcount import OpCounter, parameter_storage_keys, storage_key
from autopipe.profiler.options import AnalyticOptions
from autopipe.profiler.reduce import (
    BlockReduction,
    block_units,
    expand_profile,
    find_block_reduction,
    periods_match,
    shortened,
    still_the_blocks,
)
from autopipe.profiler.tensor_parallel import annotate_tensor_parallel
from autopipe.profiler.trace import TraceError
from autopipe.profiler.tree import tensor_leaves
from autopipe.profiler.units import UnitGraph, trace_units
from torch import fx, nn
from torch.fx.experimental import _config as fx_config
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map
from tqdm.auto import tqdm

from autopipe.core.catalog import DeviceSpec, get_device, normalize_dtype
from autopipe.core.errors import UsageError
from autopipe.core.optimizer import normalize_optimizer, resolve_optimizer
from autopipe.core.profile import Profile, UnitProfile
from autopipe.core.profile_records import Counting

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class AnalyticProfileError(UsageError, ValueError):
    """The model or its inputs cannot be profiled analytically."""


# ---------------------------------------------------------------------------------------
# Meta model and inputs
# ---------------------------------------------------------------------------------------


def _meta_model(
    model_or_factory: nn.Module | Callable[[], nn.Module], dtype: torch.dtype
) -> nn.Module:
    if isinstance(model_or_factory, nn.Module):
        model = model_or_factory
        ties = _tied_groups(model)
        on_meta = all(t.is_meta for t in [*model.parameters(), *model.buffers()])
        if not on_meta:
            # Copy so the caller's model keeps its weights; fine for models that fit in RAM.
            model = copy.deepcopy(model).to("meta")
    elif callable(model_or_factory):
        with torch.device("meta"):
            model = model_or_factory()
        if not isinstance(model, nn.Module):
            raise AnalyticProfileError(
                f"the model factory returned {type(model).__name__}, expected an nn.Module"
            )
        ties = _tied_groups(model)
    else:
        raise AnalyticProfileError(
            "expected an nn.Module or a function returning one, "
            f"got {type(model_or_factory).__name__}"
        )
    model = model.to(dtype)
    _retie(model, ties)
    model.train()
    return model


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one shared Parameter (tied weights), grouped."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(model: nn.Module, ties: list[list[str]]) -> None:
    """Device/dtype conversion may give each name its own Parameter: share them again."""
    for names in ties:
        shared = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)


def _meta_inputs(example_inputs: Any, dtype: torch.dtype) -> Any:
    def convert(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            x = x.to("meta")
            return x.to(dtype) if x.is_floating_point() else x
        return x

    return tree_map(convert, example_inputs)


def _batch_size(inputs: Any) -> int:
    try:
        return batch_size_of(inputs)
    except TypeError as exc:
        raise AnalyticProfileError(str(exc)) from None


# ---------------------------------------------------------------------------------------
# Forward/backward attribution
# ---------------------------------------------------------------------------------------


_SDPA_FUNCTIONS = (
    F.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
)


class _AutogradTagger(TorchFunctionMode):
    """Tags each new autograd node with the unit current when it was created, so that
    backward ops are booked to the same unit; routes SDPA to the fused attention op, or to
    its math decomposition where the fused op does not apply."""

    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter
        self.tagged: set[Any] = set()
        self._keep: list[Any] = []

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _SDPA_FUNCTIONS:
            out = _attention_on_meta(func, args, kwargs)
            self._tag(out)
            return out
        out = func(*args, **kwargs)
        self._tag(out)
        return out

    def _tag(self, out: Any) -> None:
        if not torch.is_grad_enabled():
            return
        stack: list[Any] = [
            t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn
        ]
        unit = self.counter.unit
        while stack:
            node = stack.pop()
            if node is None or node in self.tagged:
                continue
            self.tagged.add(node)
            self._keep.append(node)
            node.register_prehook(self._make_hook(unit))
            stack.extend(next_node for next_node, _ in node.next_functions)

    def _make_hook(self, unit: int) -> Callable[[Any], None]:
        counter = self.counter

        def hook(grad_outputs: Any) -> None:
            counter.unit = unit

        return hook


def _fused_attention(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """SDPA through the fused flash-attention op, as the CPU backend runs it (CUDA's flash /
    memory-efficient kernels save the same O(seq) tensors). A boolean mask becomes the
    additive float mask the backend builds. ``None`` (fall back to SDPA's decomposition)
    for dropout, grouped-query attention or heads of different shapes."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
    mask = bound.get("attn_mask")
    if not (
        isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    ):
        return None
    if (
        bound.get("dropout_p", 0.0)
        or bound.get("enable_gqa", False)
        or not all(t.is_meta for t in (q, k, v))
        or q.shape[:-2] != k.shape[:-2]
        or q.dim() != 4
        # the fused kernels (and their FLOP formulas) need one head size for q, k and v
        or not q.shape[-1] == k.shape[-1] == v.shape[-1]
        # a learned mask (T5's relative position bias) needs its gradient: the fused CPU
        # kernel has none for it
        or (isinstance(mask, torch.Tensor) and mask.requires_grad)
    ):
        return None
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            mask.logical_not(), float("-inf")
        )
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q,
        k,
        v,
        0.0,
        bool(bound.get("is_causal", False)),
        attn_mask=mask,
        scale=bound.get("scale"),
    )
    return out


def _math_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA written out as the math backend computes it: ``softmax(q k^T * scale + mask) v``
    (matmuls the FLOP counter knows, O(seq^2) saved scores). For shapes the fused kernels do
    not take and kernels that do not run on meta."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(
            query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device
        ).tril()
        scores = scores.masked_fill(keep.logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            scores = scores + attn_mask
    weights = torch.softmax(scores, dim=-1)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    return torch.matmul(weights, value)


def _attention_on_meta(func: Callable[..., Any], args: tuple, kwargs: dict) -> torch.Tensor:
    """SDPA on meta: the fused op where it applies, else torch's own dispatch, else (a
    kernel that cannot run on meta) the math decomposition."""
    out = _fused_attention(args, kwargs)
    if out is not None:
        return out
    try:
        return func(*args, **kwargs)
    except (RuntimeError, NotImplementedError, AssertionError):
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        bound = dict(zip(names, args, strict=False))
        bound.update(kwargs)
        return _math_attention(**bound)


@contextlib.contextmanager
def _fused_attention_everywhere() -> Iterator[None]:
    """Also route SDPA calls made *inside* other torch functions (``nn.MultiheadAttention``
    calls it from ``F.multi_head_attention_forward``, where a torch-function mode is not
    active): the module attribute is swapped while profiling; only meta inputs are affected."""
    original = F.scaled_dot_product_attention

    def routed(*args: Any, **kwargs: Any) -> torch.Tensor:
        return _attention_on_meta(original, args, kwargs)

    F.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


# ---------------------------------------------------------------------------------------
# The profiler
# ---------------------------------------------------------------------------------------


def profile_analytic(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    example_inputs: Any,
    device: str | DeviceSpec,
    options: AnalyticOptions | None = None,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    progress: bool = False,
    tp_plan: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None,
) -> Profile:
    """Per-unit time and memory of one training step, counted on the meta device.

    ``model_or_factory``: an ``nn.Module`` (copied to meta) or a zero-argument function
    building one (called under ``torch.device("meta")``: nothing is allocated).
    ``example_inputs``: a tensor, a tuple of positional tensors or a dict of keyword
    tensors at the profile's batch size ``B`` (dim 0); only shapes and dtypes are used.
    Floating inputs and parameters are cast to ``options.dtype``.
    ``device``: a catalog name (``"a100-80gb"``) or a :class:`DeviceSpec`.
    ``options``: how to count (:class:`autopipe.profiler.options.AnalyticOptions`: dtype,
    units, micro-batch sizes, efficiency, training state, sharing; default: its defaults).
    ``loss_fn(output, example_inputs)`` drives backward; default: the shared objective
    (:func:`autopipe.profiler.objective.default_loss`).
    The loss's time is kept apart (``Profile.loss_forward_s``/``loss_backward_s``) and
    its saved tensors count in the last unit, as in the measured profiler.
    ``options.microbatch_sizes``: sizes also counted to fit ``t(b) = a + c * b`` per unit
    (``a`` = ``forward_overhead_s``: launches and weight reads that small micro-batches do
    not shrink).
    ``progress``: a tqdm bar over the counting passes (one per micro-batch size).
    ``options.share=True``: a stack of repeated blocks is traced and counted as its first
    few blocks and the counts repeated (:mod:`autopipe.profiler.reduce`; the same figures,
    in the time of a few blocks).
    ``tp_plan``: the model's tensor-parallel plan (or a function returning it, a model file's
    ``tp_plan``); None: the model's own (Hugging Face), else none
    (:mod:`autopipe.profiler.tensor_parallel` fills the profile's TP fields).
    Returns a ``Profile`` with ``mode="analytic"``; seconds are for the whole batch.
    """
    started = time.perf_counter()
    opts = options if options is not None else AnalyticOptions()
    target = _target(device, opts)
    model = _meta_model(model_or_factory, target.torch_dtype)
    inputs = _meta_inputs(example_inputs, target.torch_dtype)
    big_b = _batch_size(inputs)
    sizes = _sizes(big_b, opts.microbatch_sizes)
    counts, reduction, first = _count_sizes(
        model, inputs, sizes, target.spec, opts, loss_fn, progress
    )
    profile = _assemble(model, counts, sizes, target, opts, reduction, first)
    annotate_tensor_parallel(profile, model, tp_plan)
    annotate_context_expert(profile, model, inputs)
    assert profile.counting is not None  # _build_profile sets it
    profile.counting.seconds = time.perf_counter() - started
    return profile


@dataclasses.dataclass(frozen=True)
class _Target:
    """What the counts are priced for: the device (efficiency applied), the dtype and the
    training state per parameter."""

    spec: DeviceSpec
    dtype_name: str
    torch_dtype: torch.dtype
    optimizer: str
    """Resolved (``auto`` chosen by the dtype's element size)."""
    optimizer_chosen: bool
    """The optimizer was named, not ``auto``."""


def _target(device: str | DeviceSpec, opts: AnalyticOptions) -> _Target:
    """``device`` and ``opts`` checked and resolved before anything is counted: one
    :class:`AnalyticProfileError` naming what is wrong (a CUDA device, an unknown dtype or
    optimizer, a device lacking the dtype, a non-positive ``bytes_per_parameter``)."""
    if isinstance(device, str) and device.strip().lower().startswith("cuda"):
        raise AnalyticProfileError(
            "device='cuda' measures on the GPU: use autopipe.profiler.profile (the measured "
            "profiler); profile_analytic takes a catalog name such as 'a100-80gb'"
        )
    spec = _apply_efficiency(get_device(device), opts.efficiency)
    dtype_name = normalize_dtype(opts.dtype)
    if dtype_name not in _TORCH_DTYPES:
        raise AnalyticProfileError(
            f"dtype {opts.dtype!r} is not supported; use bfloat16, float16 or float32"
        )
    spec.peak_for(dtype_name, allow_tf32=opts.allow_tf32)  # fail early if the device lacks it
    torch_dtype = _TORCH_DTYPES[dtype_name]
    try:
        optimizer_chosen = normalize_optimizer(opts.optimizer) != "auto"
        element_bytes = torch.empty((), dtype=torch_dtype).element_size()
        optimizer = resolve_optimizer(opts.optimizer, element_bytes)
    except ValueError as exc:
        raise AnalyticProfileError(str(exc)) from None
    per_parameter = opts.bytes_per_parameter
    if per_parameter is not None and not per_parameter > 0:
        raise AnalyticProfileError(f"bytes_per_parameter={per_parameter} must be positive")
    return _Target(spec, dtype_name, torch_dtype, optimizer, optimizer_chosen)


def _count_sizes(
    model: nn.Module,
    inputs: Any,
    sizes: Sequence[int],
    spec: DeviceSpec,
    opts: AnalyticOptions,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    progress: bool,
) -> tuple[list[_Count], BlockReduction | None, int | None]:
    """One count per micro-batch size (``sizes[0]`` = B, the batch of ``inputs``), shortened
    to the model's first blocks while that gives the same per-block counts at every size,
    else every size counted in full. Returns the counts, the reduction they were counted
    under (None: in full) and its first block unit. Raises AnalyticProfileError when the
    units differ between sizes."""
    big_b = sizes[0]
    # Named units may be blocks the shortened model drops: count those in full.
    reduction = find_block_reduction(model) if opts.share and not opts.units else None
    bar = tqdm(
        sizes, desc=f"counting {type(model).__name__} on {spec.name}", unit="pass",
        disable=not progress, leave=False,
    )  # fmt: skip
    counts: list[_Count] = []
    traced: dict[str, UnitGraph] = {}
    first: int | None = None

    def count(size_inputs: Any) -> _Count:
        return _count(
            model, size_inputs, spec, opts.granularity, loss_fn, opts.allow_tf32,
            opts.units or None, traced,
        )  # fmt: skip

    for b in bar:
        bar.set_postfix_str(f"micro-batch {b}")
        size_inputs = slice_batch(inputs, b, big_b)
        if reduction is not None:
            shortened_count = _count_shortened(
                model, size_inputs, spec, opts, loss_fn, traced, reduction
            )
            if shortened_count is not None:
                counts.append(shortened_count[0])
                first = shortened_count[1]
                continue
            # The earlier sizes were counted shortened: count them again in full.
            counts = [count(slice_batch(inputs, c.batch_size, big_b)) for c in counts]
            reduction = None
        counts.append(count(size_inputs))
    base = counts[0]
    for other in counts[1:]:
        if other.units.unit_names != base.units.unit_names:
            raise AnalyticProfileError(
                "the units differ between micro-batch sizes (shape-specialised tracing); "
                "pass microbatch_sizes=() to count the full batch only"
            )
    return counts, reduction, first


def _count_shortened(
    model: nn.Module,
    inputs: Any,
    spec: DeviceSpec,
    opts: AnalyticOptions,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    traced: dict[str, UnitGraph],
    reduction: BlockReduction,
) -> tuple[_Count, int] | None:
    """The count of the model shortened to its first blocks and its first block unit, or
    None when the shortened model does not run or its blocks' counts do not repeat (the
    model is then counted in full)."""
    try:
        with shortened(model, reduction):
            if not still_the_blocks(model, reduction):
                raise AnalyticProfileError("another block container")
            count = _count(
                model, inputs, spec, opts.granularity, loss_fn, opts.allow_tf32,
                opts.units or None, traced, "shortened",
            )  # fmt: skip
        first = block_units(count.units, reduction)
    except AnalyticProfileError:
        return None
    if first is not None and periods_match(count.units, reduction, first):
        return count, first
    return None


def _assemble(
    model: nn.Module,
    counts: list[_Count],
    sizes: Sequence[int],
    target: _Target,
    opts: AnalyticOptions,
    reduction: BlockReduction | None,
    first: int | None,
) -> Profile:
    """The profile at the full batch from ``counts`` (one per size in ``sizes``): the
    smaller sizes' cost parts and the training-state choice in ``meta``, a shortened count
    expanded to every block, and the times priced (seconds)."""
    name = opts.model_name or type(model).__name__
    with shortened(model, reduction) if reduction is not None else contextlib.nullcontext():
        profile = _build_profile(
            counts[0], model, target.spec, target.dtype_name, target.torch_dtype,
            target.optimizer, name, opts.bytes_per_parameter,
        )  # fmt: skip
    assert profile.counting is not None  # _build_profile sets it
    profile.counting.smaller_sizes = [
        {"microbatch_size": b, "units": _cost_parts(c.counter)}
        for b, c in zip(sizes[1:], counts[1:], strict=True)
    ]
    per_parameter = opts.bytes_per_parameter
    profile.optimizer_chosen = target.optimizer_chosen or per_parameter is not None
    if per_parameter is not None:
        profile.state_bytes_per_parameter = per_parameter
    if reduction is not None and first is not None:
        total = sum(
            p.numel() * p.element_size() for p in {id(q): q for q in model.parameters()}.values()
        )
        profile = expand_profile(profile, reduction, first, total)
    kernel_launch_s = target.spec.kernel_launch_overhead_s
    assert profile.counting is not None
    times = priced_times(profile.counting, profile.batch_size, 1.0, 1.0, kernel_launch_s)
    _apply_times(profile, times)
    return profile


def _sizes(big_b: int, microbatch_sizes: Sequence[int] | None) -> list[int]:
    try:
        return microbatch_sizes_to_profile(big_b, microbatch_sizes)
    except ValueError as exc:
        raise AnalyticProfileError(str(exc)) from None


@dataclasses.dataclass
class _Count:
    """One counted forward+backward at one batch size."""

    counter: OpCounter
    node_storages: dict[str, dict[int, tuple[int, bool]]]
    units: UnitGraph
    input_bytes: int
    batch_size: int


def _count(
    model: nn.Module,
    inputs: Any,
    spec: DeviceSpec,
    granularity: str,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    allow_tf32: bool,
    unit_patterns: Sequence[str] | None = None,
    traced: dict[str, UnitGraph] | None = None,
    mode: str = "full",
) -> _Count:
    """Trace, then run forward, loss and backward on meta with every op booked to a unit.

    ``traced`` keeps the trace of each ``mode`` (the whole model, or shortened to its first
    blocks) across batch sizes: a graph that is not specialised to the batch size (fx, or
    torch.export with a dynamic batch dimension) is traced once and run at every size."""
    units = _traced_units(model, inputs, granularity, unit_patterns, traced, mode)
    gm = units.graph_module
    n = units.num_units
    params = parameter_storage_keys(gm, model)
    counter = OpCounter(spec, n, params, allow_tf32=allow_tf32)
    pack = _saved_bytes_counter(counter, params, n)
    input_tensors = tensor_leaves(inputs)
    interpreter = _UnitInterpreter(gm, units.node_unit, counter)
    # Gradients left by an earlier count would turn this backward's gradient writes into
    # accumulations (extra add_ kernels); each count starts from none, as measuring does.
    trainable = [p for p in {id(q): q for q in [*model.parameters(), *gm.parameters()]}.values()]
    for p in trainable:
        p.grad = None
    try:
        with (
            _fused_attention_everywhere(),
            # A boolean mask given as an input (wav2vec2's mask_time_indices) indexes
            # through nonzero, which has no data on meta: count every element as selected,
            # an upper bound on that op's work.
            fx_config.patch(meta_nonzero_assume_all_nonzero=True),  # type: ignore[attr-defined]
            _AutogradTagger(counter),
            counter,
            torch.autograd.graph.saved_tensors_hooks(pack, _unpack),
        ):
            _run_counted(counter, interpreter, units, inputs, input_tensors, loss_fn)
    except AnalyticProfileError:
        raise
    except Exception as exc:
        where = units.unit_names[counter.unit] if counter.unit < n else "the loss"
        raise AnalyticProfileError(
            f"analytic mode runs the model on the meta device, and {where} failed there in "
            f"{counter.phase}: {_first_line(exc)} (profile it measured, without --device, "
            "or make that op meta-friendly)"
        ) from exc
    finally:
        for p in trainable:
            p.grad = None
    return _Count(
        counter=counter,
        node_storages=interpreter.node_storages,
        units=units,
        input_bytes=sum(t.untyped_storage().nbytes() for t in input_tensors),
        batch_size=_batch_size(inputs),
    )


def _run_counted(
    counter: OpCounter,
    interpreter: _UnitInterpreter,
    units: UnitGraph,
    inputs: Any,
    input_tensors: list[torch.Tensor],
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
) -> None:
    """Forward (unit by unit), loss and backward of ``units`` on ``inputs``, booked by
    ``counter`` (its hooks already entered); AnalyticProfileError for an output the
    pipeline cannot join."""
    counter.mark_inputs(input_tensors)
    # flat placeholders in, flat graph outputs out; the UnitGraph restores the structure
    flat_output = interpreter.run(*units.flat_inputs(inputs), enable_io_processing=False)
    output = units.unflatten_output(flat_output)
    try:  # refused here, at plan time, rather than by the runtime
        check_joinable_output(output, _batch_size(inputs))
    except OutputError as exc:
        raise AnalyticProfileError(str(exc)) from None
    counter.mark_outputs(tensor_leaves(output))
    # The loss: booked apart; its inputs (targets) are not pipeline traffic.
    counter.track_liveness = False
    counter.unit = units.num_units
    loss = _loss(output, inputs, loss_fn)
    counter.phase = "backward"
    loss.backward()


def _traced_units(
    model: nn.Module,
    inputs: Any,
    granularity: str,
    unit_patterns: Sequence[str] | None,
    traced: dict[str, UnitGraph] | None,
    mode: str,
) -> UnitGraph:
    """The model's units: the trace kept in ``traced[mode]`` when it is not specialised to
    the batch size (fx, or torch.export with a dynamic batch dimension), else a new trace
    (kept there). AnalyticProfileError when the model cannot be traced on meta."""
    units = traced.get(mode) if traced is not None else None
    if units is None or not (units.batch_dynamic and units.tracer in ("fx", "export")):
        try:
            units = trace_units(model, inputs, granularity, units=unit_patterns)
        except TraceError as exc:
            raise AnalyticProfileError(
                f"{exc} (analytic profiling runs on the meta device, where data-dependent "
                "control flow cannot be followed: profile this model measured instead)"
            ) from None
        if traced is not None:
            traced[mode] = units
    return units


def _saved_bytes_counter(
    counter: OpCounter, params: set[int], num_units: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A ``saved_tensors_hooks`` pack hook booking the bytes of each storage saved for
    backward, once, to the current unit of ``counter`` (``params``: storage keys of
    parameters and buffers, not counted)."""
    seen: set[int] = set()
    last = num_units - 1

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in seen and key not in params:
            seen.add(key)
            # tensors the loss saves count in the last unit (the last stage holds them)
            counter.units[min(counter.unit, last)].saved_bytes += t.untyped_storage().nbytes()
        return t

    return pack


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class _UnitInterpreter(fx.Interpreter):
    """Runs the traced graph node by node, making each node's unit current first."""

    def __init__(self, gm: fx.GraphModule, node_unit: dict[str, int], counter: OpCounter) -> None:
        super().__init__(gm)
        self.node_unit = node_unit
        self.counter = counter
        self.node_storages: dict[str, dict[int, tuple[int, bool]]] = {}
        """fx node name -> {storage key: (bytes, is floating)} of the tensors it produced."""

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "output":
            self.counter.unit = self.node_unit.get(n.name, self.counter.unit)
        result = super().run_node(n)
        self.node_storages[n.name] = {
            storage_key(t): (t.untyped_storage().nbytes(), t.is_floating_point())
            for t in tensor_leaves(result)
            if storage_key(t) not in self.counter.parameter_storages
        }
        return result


def _loss(
    output: Any, inputs: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None
) -> torch.Tensor:
    try:
        loss = objective.loss_of(output, inputs, loss_fn)
    except objective.ObjectiveError as exc:
        raise AnalyticProfileError(str(exc)) from None
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        raise AnalyticProfileError(
            "the loss does not require grad; does the model have trainable parameters?"
        )
    return loss


def _apply_efficiency(
    spec: DeviceSpec, efficiency: float | Mapping[str, float] | None
) -> DeviceSpec:
    if efficiency is None:
        return spec
    if isinstance(efficiency, (int, float)):
        return spec.with_efficiency(compute=float(efficiency))
    unknown = set(efficiency) - {"compute", "memory", "kernel_launch_overhead_s"}
    if unknown:
        raise AnalyticProfileError(
            f"unknown efficiency key(s) {sorted(unknown)}; use compute, memory, kernel_launch_overhead_s"
        )
    return spec.with_efficiency(
        compute=efficiency.get("compute"),
        memory=efficiency.get("memory"),
        kernel_launch_overhead_s=efficiency.get("kernel_launch_overhead_s"),
    )


def _cost_parts(counter: OpCounter) -> list[dict[str, Any]]:
    """Per unit (and the loss last): the priced parts of forward and backward."""
    return [
        {"forward": c.forward.to_dict(), "backward": c.backward.to_dict()} for c in counter.units
    ]


def _build_profile(
    count: _Count,
    model: nn.Module,
    spec: DeviceSpec,
    dtype_name: str,
    torch_dtype: torch.dtype,
    optimizer: str,
    model_name: str,
    bytes_per_parameter: float | None = None,
) -> Profile:
    """The profile at the full batch; times are filled in by :func:`_apply_times`."""
    ug = count.units
    outputs, grad_inputs = _boundary_bytes(ug, count.node_storages)
    accounting, parameter_bytes_total = parameter_accounting(
        ug, model, optimizer, bytes_per_parameter
    )
    parts = _cost_parts(count.counter)
    units: list[UnitProfile] = []
    for index, name in enumerate(ug.unit_names):
        cost = count.counter.units[index]
        units.append(
            UnitProfile(
                name=name or "model",
                kind=ug.unit_kinds[index],
                **accounting[index],
                activation_bytes=cost.saved_bytes,
                output_bytes=outputs[index],
                # as the measured CPU profile: saved + outputs + gradients of the unit's inputs
                peak_bytes=cost.saved_bytes + outputs[index] + grad_inputs[index],
                forward_flops=cost.forward.flops,
                backward_flops=cost.backward.flops,
                linear_forward_flops=cost.forward.linear_flops,
            )
        )
    return Profile(
        **profile_header(ug, torch_dtype, model_name),
        units=units,
        cut_bytes=count.counter.cut_bytes(),
        batch_size=count.batch_size,
        device=spec.name,
        mode="analytic",
        input_bytes=count.input_bytes,
        total_activation_bytes=sum(u.activation_bytes for u in units),
        parameter_bytes_total=parameter_bytes_total,
        optimizer=optimizer,
        counting=Counting(
            device_spec=spec.to_dict(),
            units=[{"name": u.name, **part} for u, part in zip(units, parts, strict=False)],
            loss=parts[-1],
        ),
    )


def _boundary_bytes(
    ug: UnitGraph, node_storages: dict[str, dict[int, tuple[int, bool]]]
) -> tuple[list[int], list[int]]:
    """Per unit, from the graph: bytes of the values it hands to later units (or returns),
    and bytes of the floating values it receives from earlier units (their gradients are what
    its backward produces for its inputs). Deduplicated by storage. O(edges)."""
    n = ug.num_units
    outputs: list[dict[int, int]] = [{} for _ in range(n)]
    received: list[dict[int, int]] = [{} for _ in range(n)]
    for node in ug.graph_module.graph.nodes:
        if node.op in ("output", "get_attr", "placeholder") or node.name not in node_storages:
            continue
        unit = ug.node_unit[node.name]
        consumers = {n if u.op == "output" else ug.node_unit[u.name] for u in node.users}
        later = {c for c in consumers if c > unit}
        for key, (nbytes, floating) in node_storages[node.name].items():
            if later:
                outputs[unit][key] = nbytes
            for c in later:
                if c < n and floating:
                    received[c][key] = nbytes
    return [sum(o.values()) for o in outputs], [sum(r.values()) for r in received]
