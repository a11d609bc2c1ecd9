"""Which parts of each unit tensor parallelism splits: the profile's TP fields, from the model's
own TP plan.

The plan (module path pattern, ``*`` standing for one path part, -> style such as ``colwise``
or ``rowwise``) comes from, in order: the ``tp_plan`` given (a model file's ``tp_plan()``), a Hugging Face model's own
``_tp_plan`` (its config's ``base_model_tp_plan`` under the base model's prefix, plus the head's
entries), or the config's ``base_model_tp_plan`` prefixed by hand. A model with none gets an
empty plan and ``Profile.tp_note`` says so; the planner then uses T = 1. Only what
``autopipe run`` applies is kept (:func:`runnable_tp_plan`); ``tp_note`` names the rest.

Per unit (O(modules x patterns) in all, no forward pass; works on meta and on real models, so
the measuring and the counting profiler share it):

- ``tp_parameter_count``: elements of the split modules' parameters in the unit (``weight`` of
  every split module, ``bias`` too for column-wise ones; a row-wise bias is replicated);
- ``tp_compute_fraction``: ``tp_parameter_count / parameter_count``: a unit's matmul FLOPs are
  ``2 x rows x weight elements`` per weight, so this is the split share of its weight matmuls;
  with sequence parallelism the rest of a transformer block (norms, residual adds) is sharded
  over the sequence, so the block divides almost whole;
- ``tp_collective_bytes`` (C): per row-wise module (the end of a TP region: attention's
  output projection, the MLP's down projection) the unit's output activation (b x s x h), the
  tensors Megatron-style sequence parallelism all-gathers and reduce-scatters in forward, and
  again in backward (the planner charges 4 C over both passes). At the model's ends fewer run,
  and C is what makes the same charge carry them: half the output of a vocab-parallel
  embedding (a reduce-scatter in forward, an all-gather in backward); for column-wise modules
  no row-wise one closes in the unit (an LM head) ``(2 x input + logits) / 4``: its input
  gathered in forward and reduce-scattered in backward, and its output (logits) gathered in
  forward when its style gathers it;
- ``tp_gathered_output_bytes``: that gathered output (the logits), whole, which the planner
  leaves sharded under loss parallelism (``PlanRequest.loss_parallel``);
- ``tp_sequence_dim``: ``vocabulary.SEQUENCE_DIM`` (1) for every split unit: ``autopipe run``
  shards the activations between TP regions as ``[b, s / T, h]``, torch's ``Shard(1)``
  (runtime/distributed/mesh.py ``_styles``, ``apply_tensor_parallel``), so each of its TP
  collectives is rearranged by a ``chunk`` + ``cat`` copy, which the planner prices;
- ``tp_gathered_input_bytes``: what the unit's column-wise modules save gathered. The runtime
  gathers a norm's output once for the column-wise modules it feeds (``PrepareModuleOutput``
  Shard(1) -> Replicate, kept a DTensor) and they take it as it is
  (``ColwiseParallel(input_layouts=Replicate())``); autograd saves that whole ``[b, s, h]``
  input for the weight gradient, one tensor shared by q/k/v (gate/up). One such tensor per
  group of column-wise modules with the same parent module (an attention's q/k/v, an MLP's
  gate/up, an LM head), each the unit's hidden stream: its output for a unit a row-wise
  module closes, else its input (a head's: the previous unit's output, at most the cut). The profiler does not see the graph: a post-norm
  block, whose column-wise modules each gather their own input, is counted per group too.

``Profile.tp_degrees``: every T > 1 dividing the attention and key/value head counts (from the
config, or modules' ``num_heads`` / ``num_key_value_heads`` attributes), else the split
dimensions of the split linear layers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from autopipe.profiler.units import unit_module
from torch import nn

from autopipe.core.profile import Profile
from autopipe.core.vocabulary import (
    EMBEDDING_TP_STYLES,
    REPLICATED_TP_STYLES,
    SEQUENCE_DIM,
    TP_STYLES,
)

__all__ = [
    "annotate_tensor_parallel",
    "model_tp_plan",
    "runnable_tp_plan",
    "tied_placements",
    "tied_split",
    "tp_pattern",
]

MAX_TP_DEGREE = 64
"""The largest T listed in ``tp_degrees`` (a TP group stays inside one node)."""

_HEAD_ATTRIBUTES = (
    "num_attention_heads",
    "num_key_value_heads",
    "num_heads",
    "n_head",
    "n_kv_heads",
)

NO_PLAN_NOTE = (
    "the model has no tensor-parallel plan (no Hugging Face base_model_tp_plan and no "
    "tp_plan() in the model file)"
)


_GATHERED_OUTPUT = ("colwise_rep", "colwise_gather_output")
"""Column-wise styles whose output (an LM head's logits) is all-gathered to every TP rank."""


def model_tp_plan(model: nn.Module, given: Mapping[str, str] | None = None) -> dict[str, str]:
    """The model's TP plan as module path patterns (relative to ``model``) -> style; empty when
    it has none. ``given`` (a model file's ``tp_plan()``) wins."""
    if given:
        return {str(k): str(v) for k, v in given.items()}
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, Mapping) and own:
        return {str(k): str(v) for k, v in own.items()}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if isinstance(base, Mapping) and base:
        prefix = getattr(model, "base_model_prefix", "")
        inner = prefix and isinstance(getattr(model, prefix, None), nn.Module)
        return {(f"{prefix}.{k}" if inner else str(k)): str(v) for k, v in base.items()}
    return {}


def tp_pattern(pattern: str) -> re.Pattern[str]:
    """A TP plan's module path pattern as a regex over whole paths. Hugging Face's rule: ``*``
    stands for one path part (a layer index), never for a dotted run of parts."""
    parts = pattern.split(".")
    return re.compile(r"\.".join("[^.]+" if p == "*" else re.escape(p) for p in parts))


def _style_of(path: str, plan: Mapping[str, str]) -> str | None:
    """The style of the first pattern of ``plan`` matching ``path`` (Hugging Face's order)."""
    for pattern, style in plan.items():
        if path and tp_pattern(pattern).fullmatch(path):
            return style
    return None


def runnable_tp_plan(model: nn.Module, plan: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """The entries of ``plan`` that ``autopipe run`` can apply (a style of
    ``vocabulary.TP_STYLES``: ``embedding_rowwise`` on ``nn.Embedding`` modules whose
    vocabulary every T the heads allow divides, ``replicated_with_grad_allreduce`` on any
    module, the others on ``nn.Linear`` modules), and a note naming what was left out and why
    ("" when nothing was). A weight several modules share (a tied LM head and embedding)
    keeps its tie: either every module holding it is split with the same placement of the
    weight (the head column-wise and the embedding vocab-parallel both shard ``[V, H]`` by
    rows, so one DTensor serves both: :func:`tied_placements`), or none is, and the entries
    that would split it alone are left out. What is left out stays whole on every TP rank,
    and the profile prices it so. O(modules x patterns)."""
    kept: dict[str, str] = {}
    dropped: list[str] = []
    heads = math.gcd(*_heads(model)) if _heads(model) else 0
    for pattern, style in plan.items():
        regex = tp_pattern(pattern)
        matched = [m for path, m in model.named_modules() if path and regex.fullmatch(path)]
        kind = (
            nn.Module
            if style in REPLICATED_TP_STYLES
            else nn.Embedding
            if style in EMBEDDING_TP_STYLES
            else nn.Linear
        )
        others = sorted({type(m).__name__ for m in matched if not isinstance(m, kind)})
        odd = [
            m.num_embeddings
            for m in matched
            if isinstance(m, nn.Embedding) and heads and m.num_embeddings % heads
        ]
        if style not in TP_STYLES:
            dropped.append(f"{pattern} ({style})")
        elif others:
            dropped.append(f"{pattern} ({style} on {', '.join(others)})")
        elif odd:
            dropped.append(
                f"{pattern} ({style}: vocabulary {odd[0]} not divisible by every T the "
                f"{heads}-way heads allow)"
            )
        else:
            kept[pattern] = style
    # Splitting a tied weight in one of its modules and not in another (or by another rule)
    # would untie them and the two would train apart: leave such entries out until every
    # tie is split alike or not at all (each round drops at least one entry).
    while True:
        torn = _torn_ties(model, kept)
        if not torn:
            break
        path, owners = torn[0]
        splitting = [
            q
            for q, style in kept.items()
            if style not in REPLICATED_TP_STYLES and any(_style_of(o, {q: style}) for o in owners)
        ]
        for pattern in splitting:
            dropped.append(
                f"{pattern} ({kept.pop(pattern)}: its weight is tied to "
                f"{', '.join(o for o in owners if o != path)}, which the plan does not split "
                "alike)"
            )
    note = (
        "not split by tensor parallelism (autopipe run splits nn.Linear, and nn.Embedding by "
        f"vocabulary, with styles {', '.join(TP_STYLES)}): {'; '.join(dropped)}"
        if dropped
        else ""
    )
    return kept, note


def _weight_placement(module: nn.Module, style: str | None) -> str:
    """How ``style`` places ``module``'s weight on the TP ranks: ``rows`` (dim 0 sharded: a
    column-wise Linear's ``[out, in]``, a vocab-parallel Embedding's ``[V, H]``), ``columns``
    (a row-wise Linear's), or ``whole`` (not split, or a replicated style)."""
    if style is None or style in REPLICATED_TP_STYLES:
        return "whole"
    if isinstance(module, nn.Embedding) and style in EMBEDDING_TP_STYLES:
        return "rows"
    if isinstance(module, nn.Linear):
        return "rows" if "colwise" in style else "columns"
    return style  # a style this runtime does not apply: never equal to another module's


def tied_placements(model: nn.Module, plan: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """For every weight that several modules of ``model`` share: its first holder's module
    path -> {each holder's module path: how ``plan`` places the weight there
    (:func:`_weight_placement`)}. O(modules x patterns)."""
    holders: dict[int, dict[str, str]] = {}
    for path, module in model.named_modules():
        weight = module._parameters.get("weight")
        if isinstance(weight, nn.Parameter):
            placement = _weight_placement(module, _style_of(path, plan))
            holders.setdefault(id(weight), {})[path] = placement
    return {next(iter(h)): h for h in holders.values() if len(h) > 1}


def _torn_ties(model: nn.Module, plan: Mapping[str, str]) -> list[tuple[str, list[str]]]:
    """The tied weights ``plan`` places differently in their holders: (a holder it splits,
    every holder's path), in model order."""
    out = []
    for placed in tied_placements(model, plan).values():
        if len(set(placed.values())) > 1:
            split = next(p for p, how in placed.items() if how != "whole")
            out.append((split, list(placed)))
    return out


def tied_split(model: nn.Module, plan: Mapping[str, str]) -> str:
    """The one-line reason tensor parallelism cannot run ``model`` under ``plan`` because the
    plan splits a weight several modules share (a tied LM head and embedding) in one of them
    and not in another, or by another rule: that unties them and the two train apart; ""
    when every tied weight is split alike in all its holders (vocab-parallel: the embedding
    ``embedding_rowwise``, the head column-wise) or in none. O(modules x patterns)."""
    for split, owners in _torn_ties(model, plan):
        placed = tied_placements(model, plan)[owners[0]]
        ways = ", ".join(f"{o} {placed[o]}" for o in owners)
        return (
            f"the TP plan splits {split} ({_style_of(split, plan)}) but its weight is tied "
            f"to {', '.join(o for o in owners if o != split)}, and the plan places the tied "
            f"weight differently ({ways}), which would untie them; split every holder alike "
            "(the embedding embedding_rowwise, the head colwise) or none, or untie them "
            "(Hugging Face: tie_word_embeddings=False)"
        )
    return ""


def _unit_of_module(path: str, units: list[str]) -> list[int]:
    """The units whose module is ``path`` or contains it (a module called several times is in
    each of its call's units)."""
    out = []
    for i, name in enumerate(units):
        m = unit_module(name)
        if m == "" or path == m or path.startswith(m + "."):
            out.append(i)
    return out


def _heads(model: nn.Module) -> list[int]:
    config = getattr(model, "config", None)
    found = [getattr(config, a, None) for a in _HEAD_ATTRIBUTES] if config is not None else []
    if not any(isinstance(h, int) and h > 0 for h in found):
        for module in model.modules():
            found += [getattr(module, a, None) for a in _HEAD_ATTRIBUTES]
    return sorted({h for h in found if isinstance(h, int) and not isinstance(h, bool) and h > 0})


def annotate_tensor_parallel(
    profile: Profile,
    model: nn.Module,
    tp_plan: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None,
) -> Profile:
    """Fill ``profile``'s TP fields (see the module docstring) from ``model`` (real or on meta)
    and its TP plan, in place; returns ``profile``. ``tp_plan``: a plan, or a function
    returning one (a model file's ``tp_plan``); None: the model's own."""
    given = tp_plan() if callable(tp_plan) else tp_plan
    whole_plan = model_tp_plan(model, given)
    plan, left_out = runnable_tp_plan(model, whole_plan)
    for u in profile.units:
        u.tp_parameter_count, u.tp_compute_fraction, u.tp_collective_bytes = 0, 0.0, 0
        u.tp_rowwise_output_bytes = 0
        u.tp_gathered_output_bytes = 0
        u.tp_sequence_dim, u.tp_gathered_input_bytes = 0, 0
    if not plan:
        profile.tp_plan, profile.tp_degrees = {}, []
        profile.tp_note = left_out or NO_PLAN_NOTE
        return profile
    tally = _tally_modules(model, plan, profile.unit_names)
    if not tally.matched:
        profile.tp_plan, profile.tp_degrees = {}, []
        profile.tp_note = (
            f"the model's tensor-parallel plan matches none of its modules ({len(plan)} patterns)"
        )
        return profile
    _fill_units(profile, tally)
    heads = _heads(model)
    g = 0
    for d in heads or tally.dims:
        g = math.gcd(g, d)
    profile.tp_plan = dict(plan)
    profile.tp_degrees = [t for t in range(2, min(g, MAX_TP_DEGREE) + 1) if g % t == 0]
    profile.tp_note = (
        left_out
        if profile.tp_degrees
        else "no T > 1 divides the model's heads and split dimensions"
    )
    if not profile.tp_degrees:
        profile.tp_plan = {}
    return profile


@dataclass
class _Tally:
    """Per unit, what the TP plan splits in it; the split dimensions; the modules matched."""

    split: list[int]
    """Parameters split (weights, and column-wise biases)."""
    rowwise: list[int]
    colwise: list[int]
    embedding: list[int]
    gathers: list[int]
    """Column-wise modules whose output is gathered."""
    inputs: list[set[str]]
    """Parent module paths of the column-wise modules: one gathered input each."""
    dims: list[int] = field(default_factory=list)
    """Each split Linear's split dimension, each split Embedding's rows."""
    matched: int = 0


def _tally_modules(model: nn.Module, plan: Mapping[str, str], names: list[str]) -> _Tally:
    """Walk ``model``'s modules that ``plan`` styles and book each to its unit. O(modules)."""
    n = len(names)
    tally = _Tally([0] * n, [0] * n, [0] * n, [0] * n, [0] * n, [set() for _ in range(n)])
    for path, module in model.named_modules():
        style = _style_of(path, plan)
        if style is None or style in REPLICATED_TP_STYLES:
            continue  # not split: whole on every rank
        tally.matched += 1
        count = 0
        weight = getattr(module, "weight", None)
        col = "colwise" in style
        if isinstance(weight, torch.Tensor):
            count += int(weight.numel())
            if isinstance(module, nn.Linear):
                tally.dims.append(int(weight.shape[0] if col else weight.shape[1]))
            elif isinstance(module, nn.Embedding):
                tally.dims.append(int(module.num_embeddings))
        bias = getattr(module, "bias", None)
        if col and isinstance(bias, torch.Tensor):
            count += int(bias.numel())
        for i in _unit_of_module(path, names):
            tally.split[i] += count
            if style in EMBEDDING_TP_STYLES:
                tally.embedding[i] += 1
            elif "rowwise" in style:
                tally.rowwise[i] += 1
            elif col:
                tally.colwise[i] += 1
                tally.gathers[i] += style in _GATHERED_OUTPUT
                tally.inputs[i].add(path.rpartition(".")[0])  # q/k/v share one gathered input
    return tally


def _fill_units(profile: Profile, tally: _Tally) -> None:
    """Each split unit's TP parameter count, compute fraction, collective bytes, sequence
    dimension and gathered input bytes."""
    for i, u in enumerate(profile.units):
        if not tally.split[i]:
            continue
        u.tp_parameter_count = (
            min(tally.split[i], u.parameter_count) if u.parameter_count else tally.split[i]
        )
        u.tp_compute_fraction = (
            min(u.tp_parameter_count / u.parameter_count, 1.0) if u.parameter_count else 1.0
        )
        into = profile.cut_bytes[i - 1] if i > 0 else profile.input_bytes
        # C such that the device formula, an all-gather and a reduce-scatter of C in each
        # pass (4 C in all), carries what runs: a block's region gathers its input and
        # reduce-scatters its output in each pass; a vocab-parallel embedding only
        # reduce-scatters its output in forward and gathers its gradient in backward (2 x
        # output); a column-wise module no row-wise one closes (an LM head) gathers its input
        # in forward and reduce-scatters its gradient in backward, plus its logits in forward
        # when its output is gathered.
        regions = tally.rowwise[i] * u.output_bytes + tally.embedding[i] * u.output_bytes / 2
        gathered = u.output_bytes if tally.colwise[i] and not tally.rowwise[i] else 0
        gathered = gathered if tally.gathers[i] else 0
        if tally.colwise[i] and not tally.rowwise[i]:
            regions += (2 * into + gathered) / 4
        u.tp_collective_bytes = int(regions)
        # what the forward reduce-scatters straight from a matmul (a fused async-TP sum's input)
        u.tp_rowwise_output_bytes = int(tally.rowwise[i] * u.output_bytes)
        u.tp_gathered_output_bytes = int(gathered)
        # autopipe run's layout: activations [b, s, h] sharded over dim 1 (vocabulary)
        u.tp_sequence_dim = SEQUENCE_DIM
        # each distinct gathered input, whole: the unit's hidden stream ([b, s, h]), which a
        # block's output is (its input cut may carry more: rotary cos/sin, labels) and a
        # head's input is, the previous unit's output (its own output is the logits)
        before = min(into, profile.units[i - 1].output_bytes) if i > 0 else into
        hidden = u.output_bytes if tally.rowwise[i] else before
        u.tp_gathered_input_bytes = int(len(tally.inputs[i]) * hidden)
