"""How the trainer runs each unit, applied to the profile before the search. Torch-free.

Two request options change what a unit costs on any mesh, so they rewrite the profile once
(docs/cost-model.md, "As the trainers run it"):

- ``precision="fp8"``: the unit's weight matmuls (``linear_forward_flops`` in forward, twice
  that in backward) run at the GPU's FP8 peak instead of the profile's dtype peak, both times
  the GPU's matmul ceiling for that dtype (``autopipe.core.gemm``): each unit saves
  ``3 x linear_forward_flops x (1 / (peak_dtype x c_dtype) - 1 / (peak_fp8 x c_fp8))`` seconds (a
  third in forward, two thirds in backward). Attention, norms and the rest stay as profiled.
  The casts to FP8 are memory-bound passes that torch.compile does not fuse away: the unit's
  ``fp8_cast_forward_bytes`` and ``fp8_cast_backward_bytes`` add at the GPU's memory
  bandwidth x memory efficiency (:func:`fp8_cast_s`; measured for torchtitan's compiled Llama
  block with torchao's Float8Linear, ``benchmarks/compiled_block_bytes.py --float8 on``:
  ``17 h + 3 ffn + 16`` bytes per token forward, ``39.5 h + 7 kv + 24 ffn + 8`` backward;
  0, not priced, where the profile does not know them).
  The weight matmuls a selective re-computation runs again (``selective_recompute_linear_flops``)
  save likewise, from ``selective_recompute_s``. Each activation checkpointing mode's casts are
  priced as measured for it: ``fp8_cast_selective_bytes`` less the two fields goes to
  ``selective_recompute_s`` (torchtitan's op policy: ``3 h - 2 ffn + 8`` per token), and
  ``fp8_cast_full_bytes`` less a forward's and a backward's casts to ``full_recompute_extra_s``,
  what a checkpointed stage's re-run costs beyond its forward (``-(5 ffn - 12)``: full AC's
  re-computation fuses with the backward).
- ``selective_recompute``: a unit with a selective recipe keeps ``selective_activation_bytes``
  and its backward re-computes ``selective_recompute_s`` first (its input-gradient part, B).
"""

from __future__ import annotations

import dataclasses

from autopipe.planner.errors import RuleViolation

from autopipe.core.catalog import DeviceSpec, get_device, is_catalog_device
from autopipe.core.gemm import gemm_ceiling
from autopipe.core.profile import Profile, UnitProfile
from autopipe.core.request import PlanRequest
from autopipe.core.vocabulary import PRECISIONS

__all__ = ["fp8_cast_s", "fp8_refusal", "fp8_saving_s", "trainer_profile"]


def _spec(profile: Profile) -> DeviceSpec:
    if not is_catalog_device(profile.device):
        raise RuleViolation(
            f"precision fp8: the profile's device {profile.device!r} is not a catalog GPU, so "
            "its FP8 peak is unknown; profile for a catalog device (--device NAME)"
        )
    return get_device(profile.device)


def fp8_saving_s(spec: DeviceSpec, dtype: str, linear_forward_flops: float) -> float:
    """Forward seconds saved by running ``linear_forward_flops`` at the FP8 peak instead of
    ``dtype``'s (each at the GPU's matmul ceiling for that dtype, ``gemm_ceiling``); the
    backward saves twice this."""
    if "float8" not in spec.peak_flops_per_s:
        raise RuleViolation(
            f"precision fp8: {spec.name} has no FP8 tensor cores in the catalog "
            f"(it lists {', '.join(sorted(spec.peak_flops_per_s))}); use precision bf16"
        )
    # each dtype at the GPU's published matmul ceiling (autopipe.core.gemm: an H100's FP8
    # GEMMs reach a smaller share of their peak than its BF16 ones)
    slow = spec.peak_for(dtype) * gemm_ceiling(spec, dtype)
    fast = spec.peak_flops_per_s["float8"] * gemm_ceiling(spec, "float8")
    return max(linear_forward_flops / slow - linear_forward_flops / fast, 0.0)


def _shrunk(total: float, overhead: float, saving: float) -> float:
    """``total`` less ``saving``, never below its per-call ``overhead``."""
    return max(total - saving, min(overhead, total))


def fp8_cast_s(spec: DeviceSpec, cast_bytes: float) -> float:
    """Seconds the FP8 casts' ``cast_bytes`` (``UnitProfile.fp8_cast_forward_bytes`` or
    ``fp8_cast_backward_bytes``) take: memory-bound, at the GPU's memory bandwidth times its
    memory efficiency, as the analytic profiler prices element-wise ops. A difference of
    bytes (a checkpointing mode's casts less those priced) gives a difference of seconds."""
    return cast_bytes / (spec.memory_bandwidth_bytes_per_s * spec.memory_efficiency)


def _fp8_unit(u: UnitProfile, spec: DeviceSpec, dtype: str) -> UnitProfile:
    if u.linear_forward_flops <= 0:
        return u
    fwd_saving = fp8_saving_s(spec, dtype, u.linear_forward_flops)
    fwd = _shrunk(u.forward_s, u.forward_overhead_s, fwd_saving)
    bwd = _shrunk(u.backward_s, u.backward_overhead_s, 2 * fwd_saving)
    fwd += fp8_cast_s(spec, u.fp8_cast_forward_bytes)
    bwd += fp8_cast_s(spec, u.fp8_cast_backward_bytes)
    scale = bwd / u.backward_s if u.backward_s > 0 else 1.0
    # a selective re-computation re-runs some of the weight matmuls, in FP8 like the rest
    redo_saving = fp8_saving_s(spec, dtype, u.selective_recompute_linear_flops)
    priced_bytes = u.fp8_cast_forward_bytes + u.fp8_cast_backward_bytes
    # each checkpointing mode's casts as measured for it: what the re-computation moves
    # beyond the two fields (fused with the backward's own casts, so it may be less than a
    # forward's); the selective one runs in the backward (B), the full one in its re-run
    redo_casts = u.fp8_cast_selective_bytes - priced_bytes if u.fp8_cast_selective_bytes else 0
    full_casts = (
        u.fp8_cast_full_bytes - priced_bytes - u.fp8_cast_forward_bytes
        if u.fp8_cast_full_bytes
        else 0
    )
    return dataclasses.replace(
        u,
        forward_s=fwd,
        backward_s=bwd,
        backward_input_s=u.backward_input_s * scale,
        backward_weight_s=u.backward_weight_s * scale,
        selective_recompute_s=max(
            u.selective_recompute_s - redo_saving + fp8_cast_s(spec, redo_casts), 0.0
        ),
        # never below re-running nothing of the forward's size-dependent part
        full_recompute_extra_s=max(
            u.full_recompute_extra_s + fp8_cast_s(spec, full_casts),
            -(fwd - min(u.forward_overhead_s, fwd)),
        ),
    )


def _selective_unit(u: UnitProfile) -> UnitProfile:
    if u.selective_activation_bytes <= 0 and u.selective_recompute_s <= 0:
        return u
    split = u.backward_input_s + u.backward_weight_s > 0
    return dataclasses.replace(
        u,
        activation_bytes=min(u.selective_activation_bytes, u.activation_bytes),
        backward_s=u.backward_s + u.selective_recompute_s,
        backward_input_s=u.backward_input_s + u.selective_recompute_s if split else 0.0,
    )


def fp8_refusal(profile: Profile) -> str | None:
    """Why ``precision="fp8"`` cannot plan ``profile``, as a phrase to follow the profile's
    name (one line), or None: no unit records weight-matmul FLOPs, so FP8 would change
    nothing and a bf16 plan would pass for an FP8 one. O(units)."""
    if any(u.linear_forward_flops > 0 for u in profile.units):
        return None
    return (
        "records no weight-matmul FLOPs (linear_forward_flops: written before autopipe "
        "counted them, or a model without nn.Linear); profile the model again, or use "
        "precision bf16"
    )


def trainer_profile(profile: Profile, request: PlanRequest) -> Profile:
    """``profile`` with the request's precision and selective checkpointing applied (itself
    when neither is asked). O(units). Refuses (``RuleViolation``) an unknown precision, FP8
    on a device without an FP8 peak, and FP8 on a profile without weight-matmul FLOPs."""
    if request.precision not in PRECISIONS:
        raise RuleViolation(f"precision={request.precision!r}; use one of {', '.join(PRECISIONS)}")
    fp8 = request.precision == "fp8"
    if not fp8 and not request.selective_recompute:
        return profile
    units = list(profile.units)
    if fp8:
        spec = _spec(profile)
        refusal = fp8_refusal(profile)
        if refusal is not None:
            raise RuleViolation(f"precision fp8: the profile {refusal}")
        units = [_fp8_unit(u, spec, profile.dtype) for u in units]
    if request.selective_recompute:
        units = [_selective_unit(u) for u in units]
    out = dataclasses.replace(profile, units=units, meta=dict(profile.meta))
    out.meta["trainer"] = {
        "precision": request.precision,
        "selective_recompute": request.selective_recompute,
    }
    return out
