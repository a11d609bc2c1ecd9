"""The facts context and expert parallelism are priced from, per unit (``UnitProfile``'s
``attention_*`` and ``moe_*`` fields, ``Profile.sequence_length``): read from the model's
modules (real or on meta), as :mod:`autopipe.profiler.tensor_parallel` reads the TP plan.

- Attention: every module whose class name ends in ``Attention`` (Hugging Face's
  ``LlamaAttention``, ``DeepseekV3Attention``, ...; one inside another counts once), its heads,
  key/value heads and head sizes from its own attributes or its ``config`` (MLA: the query
  heads, ``qk_head_dim`` and ``v_head_dim``: the keys and values attention computes with).
- Mixture of experts: every module whose class name ends in ``Experts`` holding the routed
  experts (Hugging Face 5's fused 3-D expert weights, ``num_experts``), its parameter
  elements, the experts each token meets (``top_k`` / ``num_experts_per_tok`` of the module,
  its parent or the model's config) and the hidden size.
- The sequence length: the second dimension of the first integer (token id) tensor of the
  inputs, else of the first floating tensor with three dimensions.

O(modules).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from autopipe.profiler.units import unit_module
from torch import nn

from autopipe.core.profile import Profile

__all__ = ["annotate_context_expert", "sequence_length"]


def _first_int(*values: Any) -> int:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)


def sequence_length(inputs: Any) -> int:
    """Tokens per sample of ``inputs`` (see the module docstring); 0 when none is found."""
    tensors = list(_tensors(inputs))
    for t in tensors:
        if t.dim() == 2 and not t.is_floating_point() and t.dtype != torch.bool:
            return int(t.shape[1])
    for t in tensors:
        if t.dim() == 3 and t.is_floating_point():
            return int(t.shape[1])
    return 0


def _units_of(path: str, names: list[str]) -> list[int]:
    """The units whose module is ``path`` or contains it."""
    return [
        i
        for i, name in enumerate(names)
        if (m := unit_module(name)) == "" or path == m or path.startswith(m + ".")
    ]


def _attention_shape(module: nn.Module, config: Any) -> tuple[int, int, int, int]:
    """(heads, key/value heads, key head size, value head size) of an attention module."""
    heads = _first_int(
        getattr(module, "num_heads", None),
        getattr(config, "num_attention_heads", None),
        getattr(module, "n_head", None),
    )
    kv = _first_int(
        getattr(module, "num_key_value_heads", None),
        getattr(config, "num_key_value_heads", None),
        heads,
    )
    groups = getattr(module, "num_key_value_groups", None)
    if isinstance(groups, int) and groups > 0 and heads and heads % groups == 0:
        kv = heads // groups
    hidden = _first_int(getattr(config, "hidden_size", None), getattr(module, "embed_dim", None))
    head_dim = _first_int(
        getattr(module, "qk_head_dim", None),
        getattr(module, "head_dim", None),
        hidden // heads if heads else 0,
    )
    value_dim = _first_int(getattr(module, "v_head_dim", None), head_dim)
    return heads, kv, head_dim, value_dim


def _top_k(module: nn.Module, parent: nn.Module | None, config: Any) -> int:
    return _first_int(
        getattr(module, "top_k", None),
        getattr(parent, "top_k", None) if parent is not None else None,
        getattr(getattr(parent, "gate", None), "top_k", None) if parent is not None else None,
        getattr(config, "num_experts_per_tok", None),
    )


def annotate_context_expert(profile: Profile, model: nn.Module, inputs: Any) -> Profile:
    """Fill ``profile``'s attention and MoE fields and its sequence length from ``model`` and
    its example ``inputs``, in place; returns ``profile``."""
    names = profile.unit_names
    for u in profile.units:
        u.attention_layers = u.attention_heads = u.attention_kv_heads = 0
        u.attention_head_dim = u.attention_value_head_dim = 0
        u.moe_layers = u.moe_experts = u.moe_top_k = 0
        u.moe_expert_parameter_count = u.moe_hidden_size = 0
    profile.sequence_length = sequence_length(inputs)
    model_config = getattr(model, "config", None)
    modules = dict(model.named_modules())
    inside: list[str] = []  # attention modules already counted: one inside another is theirs
    for path, module in modules.items():
        kind = type(module).__name__
        config = getattr(module, "config", model_config)
        if kind.endswith("Attention"):
            if any(path.startswith(p + ".") for p in inside):
                continue
            inside.append(path)
            heads, kv, dim, vdim = _attention_shape(module, config)
            if not heads or not dim:
                continue
            for i in _units_of(path, names):
                u = profile.units[i]
                u.attention_layers += 1
                u.attention_heads, u.attention_kv_heads = heads, kv
                u.attention_head_dim, u.attention_value_head_dim = dim, vdim
        elif kind.endswith("Experts") and _first_int(getattr(module, "num_experts", None)):
            parent = modules.get(path.rpartition(".")[0]) if "." in path else None
            count = sum(int(p.numel()) for p in module.parameters())
            hidden = _first_int(
                getattr(config, "hidden_size", None), getattr(module, "hidden_dim", None)
            )
            for i in _units_of(path, names):
                u = profile.units[i]
                u.moe_layers += 1
                u.moe_experts = int(module.num_experts)
                u.moe_top_k = _top_k(module, parent, config)
                u.moe_expert_parameter_count += count
                u.moe_hidden_size = hidden
    return profile
