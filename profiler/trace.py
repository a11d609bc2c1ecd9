"""The tracer chain: turn an nn.Module into a torch.fx GraphModule.

Order tried (the first that works wins, ``tracer`` names it):

1. ``"fx"``: ``torch.fx.symbolic_trace`` (fast, keeps ``call_module`` nodes and
   records ``nn_module_stack`` for nodes inside modules).
2. ``"export"``: ``torch.export.export(model, args, kwargs, strict=False).module()``
   (handles shape-dependent Python control flow, cache objects, ...; ATen-level nodes with
   ``nn_module_stack`` metadata). The batch dimension (dim 0 of every input tensor of the
   batch's size) is exported as dynamic (``Dim.AUTO``), so the graph runs at any
   micro-batch size; where export has to specialise it, guards or asserts on it (Python
   control flow on the batch size: ``if x.shape[0] > 4``), or fails with it dynamic, the
   graph is static and :func:`batch_is_dynamic` says so, and the runtimes trace again at
   the micro-batch size.
3. ``"hooks"``: only for models whose ``forward`` is a plain chain of children
   (each child called once, each fed the previous child's output): the chain is observed with
   forward hooks on one real run and rebuilt as a graph of ``call_module`` nodes, so the
   children are profiled as opaque units. A warning says so. The chain is the one run's
   (a forward that picks children by the batch size runs another chain at another size),
   so the graph is not batch-dynamic: the runtimes trace again at the micro-batch size.

If all fail, :class:`TraceError` names each cause in one line.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from autopipe.profiler.inputs import batch_size_of, split_inputs
from torch import fx, nn
from torch.export import Dim, ShapesCollection
from torch.export.graph_signature import InputKind

from autopipe.core.errors import UsageError

__all__ = [
    "TRACERS",
    "TraceError",
    "batch_is_dynamic",
    "trace_model",
    "training_config",
]


class TraceError(UsageError, RuntimeError):
    """No tracer in the chain could turn the model into a graph."""


def training_config(model: nn.Module) -> list[str]:
    """Switch off inference-only features a training trace cannot carry; returns what changed.

    A Hugging Face config with ``use_cache=True`` makes the model build and return a
    key/value cache object, which neither tracer turns into a graph of tensors and which
    training never reads (transformers itself turns it off under gradient checkpointing).
    """
    return [f"{type(m).__name__}.config.use_cache" for m in _switch_off_cache(model)]


def _switch_off_cache(model: nn.Module) -> list[nn.Module]:
    """The modules whose config had ``use_cache=True``, now False (a config shared by
    nested modules counts for the outermost one)."""
    changed: list[nn.Module] = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", False) is True:
            config.use_cache = False
            changed.append(module)
    return changed


def _generates(modules: list[nn.Module]) -> bool:
    """Whether any of ``modules`` (those whose cache was switched off) generates text and so
    reads a key/value cache. An encoder such as BERT has the flag in its config but never
    uses it (``can_generate()`` is False): turning it off needs no word, even when the
    encoder sits inside the user's own wrapper module. A module without ``can_generate``
    (not a Hugging Face model) may use its cache: it counts as generating."""
    for module in modules:
        can_generate = getattr(module, "can_generate", None)
        if not callable(can_generate) or can_generate():
            return True
    return False


SPEC_AUGMENT = (("mask_time_prob", "mask_time_indices"), ("mask_feature_prob", None))
"""Hugging Face audio configs whose masks forward draws with numpy in training (SpecAugment),
and the input that can carry the mask instead."""


def check_drawn_masks(model: nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuse a model whose ``forward`` draws a random mask from numpy (SpecAugment in
    wav2vec2, HuBERT, WavLM): no tracer sees the draw, so the graph would keep the one mask
    of the tracing call and replay it every step (or fail at another micro-batch size).
    :class:`TraceError` names the config switch and, where ``forward`` takes one, the input
    that carries a mask computed outside the model (as transformers' pretraining collator
    computes ``mask_time_indices``)."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "apply_spec_augment", False):
        return
    accepted = set(inspect.signature(model.forward).parameters)
    for prob, carrier in SPEC_AUGMENT:
        value = float(getattr(config, prob, 0.0) or 0.0)
        if value <= 0 or (carrier is not None and carrier in kwargs):
            continue
        way = (
            f"pass {carrier} (a bool tensor, batch x frames, drawn per batch with "
            "transformers' _compute_mask_indices) with the inputs, or set "
            if carrier is not None and carrier in accepted
            else "set "
        )
        raise TraceError(
            f"{type(model).__name__} draws SpecAugment's mask inside forward with numpy "
            f"(config.{prob} = {value:g}), which a traced graph would replay as one fixed "
            f"mask every step; {way}config.{prob} = 0 (or apply_spec_augment = False)"
        )


@contextlib.contextmanager
def _quiet_logging() -> Iterator[None]:
    """Silence torch's log records while a tracer that may fail runs: its failure is
    reported in our one-line error, not as a page of graph dumps."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        # torch.export also prints the partial graph of a failed trace to stderr.
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(previous)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def _unprovided_defaults(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Forward parameters the example inputs leave at their defaults (e.g. ``mask=None``).

    fx would otherwise trace them as proxies and take the ``is not None`` branch.
    """
    try:
        sig = inspect.signature(model.forward)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {}
    concrete: dict[str, Any] = {}
    for name, param in sig.parameters.items():
        if name in bound.arguments or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.default is not inspect.Parameter.empty:
            concrete[name] = param.default
    return concrete


def trace_fx(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` with unprovided defaulted parameters fixed to their defaults."""
    concrete = _unprovided_defaults(model, args, kwargs)
    return fx.symbolic_trace(model, concrete_args=concrete or None)


def _batch_dims(args: tuple, kwargs: dict) -> Any:
    """``dynamic_shapes`` marking dim 0 of every input tensor of the batch's size as
    ``Dim.AUTO`` (export may still specialise it; others stay static)."""
    try:
        batch = batch_size_of((args, kwargs))
    except TypeError:
        return None
    shapes = ShapesCollection()
    marked = False
    # Only pytree leaves: export sees tensors inside unregistered classes as constants.
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == batch:
            shapes[t] = {0: Dim.AUTO}  # the same tensor twice gets the same spec
            marked = True
    return shapes if marked else None


def batch_is_dynamic(gm: fx.GraphModule, size: int | None = None) -> bool:
    """Whether a traced graph runs at any batch size (at ``size`` rows, when given) as the
    model does: fx graphs record no shapes; a hooks graph replays the children one run
    called (another batch size may call others), so never; an export graph does when every
    batch-sized input kept a symbolic dim 0 that nothing guards, and then from export's
    smallest symbolic size on (2: export takes a size of 1 for a constant, so a branch on
    ``rows > 1`` is baked in without a guard)."""
    if not gm.meta.get("autopipe_batch_dynamic", True):
        return False
    return size is None or size >= smallest_batch_size(gm)


def smallest_batch_size(gm: fx.GraphModule) -> int:
    """The smallest batch size a batch-dynamic graph runs as the model does (2 for an export
    graph whose branch on ``rows > 1`` export baked in at a size of 1, else 1)."""
    return int(gm.meta.get("autopipe_batch_min", 1))


def trace_export(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """Non-strict ``torch.export`` flattened to one GraphModule (input guards removed), with
    a dynamic batch dimension where export allows it (static otherwise)."""
    shapes = _batch_dims(args, kwargs)
    smallest: int | None = None
    exported = None
    if shapes is not None:
        try:
            exported = torch.export.export(model, args, kwargs, dynamic_shapes=shapes, strict=False)
        except Exception:  # a model export cannot keep dynamic: trace it static below
            exported = None
    if exported is None:
        exported = torch.export.export(model, args, kwargs, strict=False)
    else:
        smallest = _smallest_dynamic_batch(exported, args, kwargs)
    gm = exported.module()
    # The input-shape guard module is a sanity check for the exported program, not part
    # of the computation; it would also be an unknown target once the graph is split.
    for node in list(gm.graph.nodes):
        if (
            node.op == "call_module"
            and str(node.target).startswith("_guards_fn")
            and not node.users
        ):
            gm.graph.erase_node(node)
            if hasattr(gm, str(node.target)):
                delattr(gm, str(node.target))
    gm.graph.lint()
    gm.recompile()
    gm.meta["autopipe_batch_dynamic"] = smallest is not None
    gm.meta["autopipe_batch_min"] = smallest or 1
    return gm


def _smallest_dynamic_batch(exported: Any, args: tuple, kwargs: dict) -> int | None:
    """The smallest batch size from which the exported program runs every size as the model
    would, or None (static): each batch-sized user input kept a symbolic dim 0 and nothing
    in the program constrains or branches on those symbols (:func:`_batch_constrained`).
    A branch on the batch size (``if x.shape[0] > 4``) is baked into the graph behind a
    guard on the symbol; another micro-batch size would run the branch of the tracing size,
    so such a graph counts as static and is traced again at each size."""
    batch = batch_size_of((args, kwargs))
    users = {
        spec.arg.name
        for spec in exported.graph_signature.input_specs
        if spec.kind == InputKind.USER_INPUT and hasattr(spec.arg, "name")
    }
    symbols: set[Any] = set()
    shape_env = None
    for node in exported.graph_module.graph.nodes:
        val = node.meta.get("val")
        if node.op != "placeholder" or node.name not in users:
            continue
        if not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        size = val.shape[0]
        # A SymInt export replaced by a number (a guard ``== 8``) is specialised too.
        expr = size.node.expr if isinstance(size, torch.SymInt) else None
        if expr is not None and expr.is_Symbol:
            symbols.add(expr)
            shape_env = size.node.shape_env
        elif int(size) == batch:
            return None  # specialised to the example's batch size
    if not symbols or _batch_constrained(exported, shape_env, symbols):
        return None
    lowest = [
        exported.range_constraints[s].lower for s in symbols if s in exported.range_constraints
    ]
    return max([1, *(int(b) for b in lowest)])


def _batch_constrained(exported: Any, shape_env: Any, symbols: set[Any]) -> bool:
    """Whether the program narrows the batch symbols below export's default range
    ``[2, oo)`` (``range_constraints``), guards on them (the shape environment's guards,
    which ``ExportedProgram.module()`` checks in ``_guards_fn``), or asserts on them at run
    time (deferred runtime asserts: ``_assert_scalar`` / ``sym_constrain_range*`` nodes).
    A condition that holds whenever all batch inputs share one size (``labels`` has the
    rows of ``input_ids``: ``Eq(8*s0, 8*s1)``) constrains nothing."""
    for symbol in symbols:
        bounds = exported.range_constraints.get(symbol)
        # An unbounded symbol's upper bound is sympy's integer infinity, above any size.
        if bounds is not None and (bounds.lower > 2 or bounds.upper < sys.maxsize):
            return True
    exprs = [guard.expr for guard in shape_env.guards]
    exprs += [a.expr for asserts in shape_env.deferred_runtime_asserts.values() for a in asserts]
    for node in exported.graph_module.graph.nodes:
        if node.op == "call_function" and node.target in _CHECKS and node.args:
            val = getattr(node.args[0], "meta", {}).get("val")
            if isinstance(val, (torch.SymBool, torch.SymInt)):
                exprs.append(val.node.expr)
    common = min(symbols, key=str)
    for expr in exprs:
        # Symbols export found equal are replaced by one of them first.
        expr = shape_env.replace(expr)
        if expr.free_symbols & symbols:
            if expr.xreplace(dict.fromkeys(symbols, common)) is not sympy.true:
                return True
    return False


_CHECKS = (
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
)
"""Graph nodes that check a symbolic value at run time."""


def trace_sequential_hooks(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """Rebuild a model whose forward is a plain chain of its children as a graph.

    Runs the model once (no grad) with forward hooks on the direct children and checks that
    the children form a chain: the first child gets exactly the model's positional inputs,
    every later child gets exactly the previous child's output, each child runs once and the
    model returns the last child's output. Raises ``TraceError`` otherwise.
    """
    if kwargs:
        raise TraceError("hooks fallback needs positional inputs only")
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any], Any]] = []
    handles = []
    for name, child in model.named_children():

        def hook(mod: nn.Module, a: tuple, kw: dict, out: Any, _name: str = name) -> None:
            calls.append((_name, a, kw, out))

        handles.append(child.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            out = model(*args)
    finally:
        for h in handles:
            h.remove()
    if not calls:
        raise TraceError("forward calls no child module")
    names = [c[0] for c in calls]
    if len(set(names)) != len(names):
        raise TraceError("forward calls a child more than once")
    first_args = calls[0][1]
    if (
        calls[0][2]
        or len(first_args) != len(args)
        or any(a is not b for a, b in zip(first_args, args, strict=False))
    ):
        raise TraceError(f"child {names[0]!r} does not receive the model inputs unchanged")
    for (_, _, _, prev_out), (name, a, kw, _) in zip(calls, calls[1:], strict=False):
        if kw or len(a) != 1 or a[0] is not prev_out:
            raise TraceError(f"child {name!r} does not take exactly the previous child's output")
    if out is not calls[-1][3]:
        raise TraceError("model output is not the last child's output")

    graph = fx.Graph()
    params = list(inspect.signature(model.forward).parameters)[: len(args)]
    value: Any = tuple(graph.placeholder(p) for p in params)
    first = True
    for name in names:
        for path in _chain_paths(model, name):
            value = graph.call_module(path, value if first else (value,))
            stack = [".".join(path.split(".")[: i + 1]) for i in range(path.count(".") + 1)]
            value.meta["nn_module_stack"] = {p: (p, type(model.get_submodule(p))) for p in stack}
            first = False
    graph.output(value)
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__)
    gm.meta["autopipe_batch_dynamic"] = False
    return gm


def _chain_paths(model: nn.Module, path: str) -> list[str]:
    """``path``, or, for a plain ``nn.Sequential`` (whose forward is always a chain of its
    children), the paths of its children, recursively: finer units for the hooks tracer."""
    module = model.get_submodule(path)
    if type(module) is not nn.Sequential or len(module) == 0:
        return [path]
    return [p for name, _ in module.named_children() for p in _chain_paths(model, f"{path}.{name}")]


TRACERS = ("fx", "export", "hooks")


def trace_model(
    model: nn.Module, example_inputs: Any, tracer: str | None = None
) -> tuple[fx.GraphModule, str]:
    """Trace ``model`` with the tracer chain; returns ``(graph_module, tracer_name)``.

    ``tracer_name`` is ``"fx"``, ``"export"`` or ``"hooks"``; ``tracer`` forces one of them
    (no fallback). Raises :class:`TraceError` with one line naming every tracer's failure.
    """
    args, kwargs = split_inputs(example_inputs)
    check_drawn_masks(model, kwargs)
    switched = _switch_off_cache(model)
    if switched and _generates(switched):
        changed = [f"{type(m).__name__}.config.use_cache" for m in switched]
        warnings.warn(
            f"set {', '.join(changed)} = False for training: a key/value cache is for "
            "generation and cannot cross pipeline stages",
            stacklevel=2,
        )
    if tracer is not None:
        funcs = {"fx": trace_fx, "export": trace_export, "hooks": trace_sequential_hooks}
        if tracer not in funcs:
            raise ValueError(
                f"tracer {tracer!r} is not one of {', '.join(TRACERS)}; pick one of those"
            )
        try:
            return funcs[tracer](model, args, kwargs), tracer
        except Exception as exc:
            raise TraceError(
                f"cannot trace {type(model).__name__} with {tracer}: {_first_line(exc)}"
            ) from None
    causes: list[str] = []
    try:
        return trace_fx(model, args, kwargs), "fx"
    except Exception as exc:  # any failure moves on to the next tracer
        causes.append(f"torch.fx.symbolic_trace failed ({_first_line(exc)})")
    try:
        with warnings.catch_warnings(), _quiet_logging():
            warnings.simplefilter("ignore")
            return trace_export(model, args, kwargs), "export"
    except Exception as exc:
        causes.append(f"torch.export(strict=False) failed ({_first_line(exc)})")
    try:
        gm = trace_sequential_hooks(model, args, kwargs)
    except Exception as exc:
        causes.append(f"not a plain chain of children for hook profiling ({_first_line(exc)})")
        raise TraceError(
            f"cannot trace {type(model).__name__}: "
            + "; ".join(causes)
            + "; make forward traceable (no data-dependent Python control flow) or a plain chain of child modules"
        ) from None
    warnings.warn(
        f"{type(model).__name__}: fx and export tracing failed ({'; '.join(causes)}); "
        "profiling at child-module granularity from forward hooks",
        stacklevel=2,
    )
    return gm, "hooks"
