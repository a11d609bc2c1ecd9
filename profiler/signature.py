"""Structural signatures of units: which units are the same computation.

Two unit calls are *the same computation* when

* their graphs match node for node: the same op kinds in the same order, each target
  normalised (a called module by its structure, a parameter, buffer or constant by shape,
  dtype and requires-grad, a function by its qualified name, a method by its name),
  arguments referring to other nodes by position within the unit, constants by value;
* the values they receive match: tensors by shape, strides, dtype, device and
  requires-grad, other values by ``repr``.

A module's structure is its class, ``training`` flag, ``extra_repr()``, its own parameters and
buffers (name, shape, dtype, requires-grad), its public attributes of plain types (``bool``,
``int``, ``float``, ``str``, ``None`` and tuples of those: hyperparameters such as
``norm_first``) and its children's structures, recursively. Module paths and parameter values
never enter a signature, so ``blocks.3`` and ``blocks.4`` of a transformer are the same
computation while a block with another width, dtype or activation is not.

Signatures are hex digests (``sha1`` of a canonical ``repr``); computing one is O(nodes of the
unit + size of the modules it calls), memoised per module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

_PLAIN = (bool, int, float, str, type(None))


def _digest(value: Any) -> str:
    return hashlib.sha1(repr(value).encode()).hexdigest()


def tensor_signature(t: torch.Tensor) -> tuple[Any, ...]:
    """What of a tensor decides the cost of computing with it: shape, strides, dtype, device
    type, requires-grad, parameter-ness (not its values, not its device index)."""
    return (
        "T",
        tuple(t.shape),
        tuple(t.stride()) if t.layout == torch.strided else str(t.layout),
        str(t.dtype),
        t.device.type,
        bool(t.requires_grad),
        isinstance(t, nn.Parameter),
    )


def value_signature(value: Any) -> Any:
    """A hashable description of an argument value: tensors by :func:`tensor_signature`,
    containers element by element, everything else by ``repr``."""
    if isinstance(value, torch.Tensor):
        return tensor_signature(value)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(value_signature(v) for v in value))
    if isinstance(value, Mapping):
        return ("dict", tuple((str(k), value_signature(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", value_signature(value.start), value_signature(value.stop), value.step)
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(value)
    return repr(value)


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    return isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)


class ModuleSignatures:
    """Memoised module structures (see the module docstring). One instance per profiling run:
    the memo keys are module ids, valid while the modules live."""

    def __init__(self) -> None:
        self._memo: dict[int, str] = {}

    def __call__(self, module: nn.Module) -> str:
        key = id(module)
        found = self._memo.get(key)
        if found is not None:
            return found
        cls = type(module)
        own = [
            (name, tensor_signature(p))
            for name, p in module.named_parameters(recurse=False)
            if p is not None
        ]
        own += [
            (name, tensor_signature(b))
            for name, b in module.named_buffers(recurse=False)
            if b is not None
        ]
        attrs = sorted(
            (k, repr(v))
            for k, v in vars(module).items()
            if not k.startswith("_") and k != "training" and _plain(v)
        )
        children = [(name, self(child)) for name, child in module.named_children()]
        try:
            extra = module.extra_repr()
        except Exception:  # a broken extra_repr must not stop profiling
            extra = ""
        sig = _digest(
            (f"{cls.__module__}.{cls.__qualname__}", module.training, extra, own, attrs, children)
        )
        self._memo[key] = sig
        return sig


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    return f"{module}.{name}" if name else str(target)


def _resolve(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def graph_signature(
    nodes: Iterable[fx.Node],
    root: nn.Module,
    modules: ModuleSignatures,
) -> str:
    """Signature of a run of graph nodes (one unit: a split partition's whole graph, or the
    unit's nodes in the traced graph). ``root`` resolves ``call_module``/``get_attr`` targets.

    A node argument produced inside the run is ``("n", position)``; one produced outside it is
    an external input, numbered by first use (``("in", k)``, with its recorded shape when the
    tracer kept one in ``node.meta["val"]``), unless it is a ``get_attr`` node, which is
    described by the tensor it fetches. O(nodes + arguments).
    """
    # Arithmetic on symbolic sizes (a dynamic batch times the heads) is no computation worth
    # a cost, and the first block of a stack often does it for all: it is left out, and
    # values it makes are inputs like any other.
    nodes = [n for n in nodes if not _is_size_arithmetic(n)]
    position = {n: i for i, n in enumerate(nodes)}
    external: dict[fx.Node, int] = {}

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a in position:
                return ("n", position[a])
            if a.op == "get_attr":
                return ("attr", _attr_signature(root, a.target))
            # export graphs record each value's shape: part of what an input is
            val = a.meta.get("val")
            shape = tensor_signature(val) if isinstance(val, torch.Tensor) else None
            return ("in", external.setdefault(a, len(external)), shape)
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(arg(x) for x in a))
        if isinstance(a, Mapping):
            return ("dict", tuple((str(k), arg(v)) for k, v in a.items()))
        return value_signature(a)

    rows = []
    for n in nodes:
        if n.op == "call_module":
            target: Any = ("module", modules(root.get_submodule(str(n.target))))
        elif n.op == "get_attr":
            target = ("attr", _attr_signature(root, n.target))
        elif n.op in ("placeholder", "output"):
            target = ""
        else:
            target = _target_name(n.target)
        rows.append((n.op, target, arg(tuple(n.args)), arg(dict(n.kwargs))))
    return _digest(rows)


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _is_size_arithmetic(node: fx.Node) -> bool:
    """A node computing a Python number from symbolic sizes (``sym_size``, ``mul``, ...)."""
    return node.op == "call_function" and isinstance(node.meta.get("val"), _SYMBOLIC)


def _attr_signature(root: nn.Module, target: Any) -> Any:
    try:
        value = _resolve(root, str(target))
    except AttributeError:
        return ("missing", str(target))
    if isinstance(value, torch.Tensor):
        return tensor_signature(value)
    if isinstance(value, nn.Module):
        return ("module", ModuleSignatures()(value))
    return value_signature(value)


def call_signature(static: str, args: Sequence[Any], activation: Sequence[bool]) -> str:
    """Signature of one unit call: its graph's ``static`` signature and its argument values
    (``activation[i]``: whether argument ``i`` comes from an earlier unit)."""
    return _digest(
        (
            static,
            tuple((value_signature(a), bool(f)) for a, f in zip(args, activation, strict=True)),
        )
    )


def group_by_signature(signatures: Sequence[str]) -> list[int]:
    """``rep[i]``: the first index with the same signature as ``i`` (``rep[i] == i`` for the
    first of each kind). O(n)."""
    first: dict[str, int] = {}
    return [first.setdefault(s, i) for i, s in enumerate(signatures)]
