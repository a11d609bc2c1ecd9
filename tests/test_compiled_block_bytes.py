"""The measured bytes of torchtitan's compiled Llama block (benchmarks/compiled_block_bytes.py)
against the formula the published-runs benchmark prices with
(``published_runs.TORCHTITAN_COMPILED_BYTES_PER_TOKEN``), at a shape the formula was not read
from."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from autopipe.planner.costs import CostModel
from autopipe.planner.trainer import trainer_profile

from autopipe.core.cluster import Cluster, Device
from autopipe.core.profile import UnitProfile
from autopipe.core.request import PlanRequest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import compiled_block_bytes as cb  # noqa: E402
import published_runs as pr  # noqa: E402

FRESH = (192, 6, 2, 384)
"""(dim, heads, kv_heads, ffn): head dim 32, kv 64; in none of ``FIT_SHAPES``."""


def _arch(dim: int, heads: int, kv_heads: int, ffn: int) -> pr.Arch:
    return pr.Arch("fresh", 1, dim, heads, kv_heads, ffn, 1024, gated=True)


@pytest.mark.slow
@pytest.mark.parametrize("ac", cb.AC_MODES)
def test_formula_matches_a_fresh_measurement(ac: str) -> None:
    """Compiling the block at :data:`FRESH` (CPU inductor, about a minute each) gives the
    formula's bytes per token exactly, forward and backward, for each activation checkpointing
    mode torchtitan offers."""
    assert FRESH not in cb.FIT_SHAPES
    fwd, bwd = cb.bytes_per_token(*FRESH, ac=ac)
    prefix = "" if ac == "none" else f"{ac}_"
    a = _arch(*FRESH)
    assert fwd == pr.torchtitan_compiled_bytes(a, f"{prefix}forward")
    assert bwd == pr.torchtitan_compiled_bytes(a, f"{prefix}backward")


@pytest.mark.slow
@pytest.mark.parametrize("ac", cb.AC_MODES)
def test_float8_formula_matches_a_fresh_measurement(ac: str) -> None:
    """The block with torchtitan's Float8 linears (torchao's ``convert_to_float8_training``,
    tensorwise dynamic) compiled at :data:`FRESH` moves the ``float8_*`` formula's bytes per
    token exactly, forward and backward, for each activation checkpointing mode; its weights'
    amax and casts, which do not scale with the tokens, are 5 bytes per weight element in
    forward and 3 in backward beyond the bf16 block (without AC), as :data:`pr.TORCHTITAN_FLOAT8_WEIGHT_BYTES`
    says."""
    pytest.importorskip("torchao")
    fwd, bwd = cb.measure_bytes(*FRESH, ac=ac, float8=True)
    prefix = "float8_" + ("" if ac == "none" else f"{ac}_")
    a = _arch(*FRESH)
    assert fwd.bytes_per_token == pr.torchtitan_compiled_bytes(a, f"{prefix}forward")
    # exact over the seven fitted shapes; at this one inductor's scheduler fuses one more pair
    # of backward kernels (a 64-byte-per-token buffer read once less): 32 bytes per token
    # fewer than the formula's 34,856 without AC (0.1%)
    formula = pr.torchtitan_compiled_bytes(a, f"{prefix}backward")
    assert 0 <= formula - bwd.bytes_per_token <= 32
    # the FP8 matmuls the backward runs: 14 of its own (two per linear) and what the AC mode
    # re-computes: torchtitan's op policy counts them as mm and re-runs the even ones (wk, wo,
    # w3: the published runs' selective_recompute_linear_flops), full AC all but w2, whose
    # output nothing in backward reads
    assert fwd.externs.count("aten._scaled_mm.out") == 7
    assert (
        bwd.externs.count("aten._scaled_mm.out") == 14 + {"none": 0, "selective": 3, "full": 6}[ac]
    )
    if ac == "none":
        base_fwd, base_bwd = cb.measure_bytes(*FRESH, ac=ac)
        weights = cb.weight_elements(*FRESH)
        per_weight = pr.TORCHTITAN_FLOAT8_WEIGHT_BYTES
        # what is left beyond the weights: the per-tensor scales and norm-weight reads
        assert 0 < fwd.fixed_bytes - base_fwd.fixed_bytes - per_weight["forward"] * weights < 2048
        assert 0 < bwd.fixed_bytes - base_bwd.fixed_bytes - per_weight["backward"] * weights < 2048


def test_llama_float8_cast_bytes_by_hand() -> None:
    """What torchtitan's Float8 adds to a compiled block, per token: forward 17 h + 3 ffn + 16,
    backward 39.5 h + 7 kv + 24 ffn + 8 (Llama 3.1 8B: 112,656 and 513,032, against the bf16
    block's 279,560 and 420,112; 70B 225,296 and 1,018,888; 405B 438,288 and 1,932,296). The
    profile of a compiled torchtitan run carries them at its batch, and precision fp8 prices
    them at the H100's memory bandwidth (2.4 TB/s x 0.8 on torchtitan's 500 W part); bf16
    does not. Failed before (no such fields; the casts were not priced)."""
    expected = {
        pr.LLAMA31_8B: (112656, 513032),
        pr.LLAMA31_70B: (225296, 1018888),
        pr.LLAMA31_405B: (438288, 1932296),
    }
    for a, (fwd, bwd) in expected.items():
        h, kv, f = a.hidden, a.kv_dim, a.ffn
        assert pr.torchtitan_fp8_cast_bytes(a, "forward") == 17 * h + 3 * f + 16 == fwd
        assert pr.torchtitan_fp8_cast_bytes(a, "backward") == 39.5 * h + 7 * kv + 24 * f + 8 == bwd
    spec = pr.get_device("H100-96GB-HBM2e-500W")
    seq = 8192
    kw = dict(gemm_tokens=seq, compiled=True, selective="torchtitan")
    p = pr.transformer_profile(pr.LLAMA31_8B, seq, spec, eager="torchtitan", **kw)
    block = p.units[1]
    assert block.fp8_cast_forward_bytes == seq * 112656
    assert block.fp8_cast_backward_bytes == seq * 513032
    assert p.units[0].fp8_cast_forward_bytes == p.units[-1].fp8_cast_forward_bytes == 0
    generic = pr.transformer_profile(pr.LLAMA31_8B, seq, spec, **kw).units[1]
    assert generic.fp8_cast_forward_bytes == generic.fp8_cast_backward_bytes == 0
    mem = 2.4e12 * 0.8
    fp8 = trainer_profile(p, PlanRequest(precision="fp8")).units[1]
    no_casts = dataclasses.replace(block, fp8_cast_forward_bytes=0, fp8_cast_backward_bytes=0)
    bare = trainer_profile(
        dataclasses.replace(p, units=[p.units[0], no_casts, *p.units[2:]]),
        PlanRequest(precision="fp8"),
    ).units[1]
    assert fp8.forward_s - bare.forward_s == pytest.approx(seq * 112656 / mem)  # 0.48 ms
    assert fp8.backward_s - bare.backward_s == pytest.approx(seq * 513032 / mem)  # 2.19 ms
    assert trainer_profile(p, PlanRequest()).units[1].forward_s == block.forward_s


def test_llama_8b_compiled_bytes_by_hand() -> None:
    """Llama 3.1 8B (h 4096, kv 1024, ffn 14336, 32 heads of 128): forward 42 h + 20 kv + 6 ffn
    + 8 head_dim + 8 = 279,560 bytes per token (the one-pass-per-fused-op count assumed before:
    188,416), backward 420,112 (assumed twice the forward, 376,832); torchtitan's selective AC
    re-computes 181,248 of them in its backward graph. A torchtitan compiled run's profile
    carries the difference at the H100's memory bandwidth; a generic one keeps the fused count."""
    a = pr.LLAMA31_8B
    fwd = pr.torchtitan_compiled_bytes(a, "forward")
    bwd = pr.torchtitan_compiled_bytes(a, "backward")
    assert fwd == 42 * 4096 + 20 * 1024 + 6 * 14336 + 8 * 128 + 8 == 279560
    assert bwd == 62 * 4096 + 20 * 1024 + 10 * 14336 + 8 * 32 + 16 * 128 + 16 == 420112
    redo = (
        pr.torchtitan_compiled_bytes(a, "selective_forward")
        + pr.torchtitan_compiled_bytes(a, "selective_backward")
        - fwd
        - bwd
    )
    assert redo == 181248
    assumed = pr.BF16 * pr._elementwise_elements(a, compiled=True)
    assert assumed == 188416
    spec = pr.get_device("H100-96GB-HBM2e-500W")
    seq = 8192
    kw = dict(gemm_tokens=seq, compiled=True, selective="torchtitan")
    tt = pr.transformer_profile(a, seq, spec, eager="torchtitan", **kw).units[1]
    gen = pr.transformer_profile(a, seq, spec, **kw).units[1]
    mem = spec.memory_bandwidth_bytes_per_s * spec.memory_efficiency
    assert tt.forward_s - gen.forward_s == pytest.approx(seq * (fwd - assumed) / mem)
    assert tt.backward_s - gen.backward_s == pytest.approx(seq * (bwd - 2 * assumed) / mem)
    assert tt.selective_recompute_s - gen.selective_recompute_s == pytest.approx(
        seq * (redo - assumed) / mem
    )


@pytest.mark.parametrize(
    "a", [pr.LLAMA31_8B, pr.LLAMA31_70B, pr.LLAMA31_405B], ids=lambda a: a.name
)
def test_fp8_casts_priced_per_checkpointing_mode_equal_the_measured_ones(a: pr.Arch) -> None:
    """What precision fp8 prices for the casts of one torchtitan block (compiled), per
    activation checkpointing mode, is the measured float8 block's bytes less the bf16 block's
    under that mode (``float8_*`` of ``TORCHTITAN_COMPILED_BYTES_PER_TOKEN``): without AC the
    forward's and backward's fields; under torchtitan's selective op policy those plus what
    ``selective_recompute_s`` gains (``3 h - 2 ffn + 8`` per token: 16,376 fewer at 8B); under
    full AC a forward, its re-run (``forward_s + full_recompute_extra_s``, as the cost model
    prices a checkpointed stage) and the backward (``5 ffn - 12`` per token fewer than a
    plain forward re-run: 71,668 at 8B). Failed before (selective priced the no-AC casts,
    full AC the forward's casts twice)."""
    spec = pr.get_device("H100-96GB-HBM2e-500W")
    seq = 8192
    kw = dict(gemm_tokens=seq, compiled=True, selective="torchtitan", eager="torchtitan")
    p = pr.transformer_profile(a, seq, spec, **kw)
    mem = spec.memory_bandwidth_bytes_per_s * spec.memory_efficiency
    block = p.units[1]
    bare_block = dataclasses.replace(
        block,
        fp8_cast_forward_bytes=0,
        fp8_cast_backward_bytes=0,
        fp8_cast_selective_bytes=0,
        fp8_cast_full_bytes=0,
    )
    bare_p = dataclasses.replace(p, units=[p.units[0], bare_block, *p.units[2:]])
    fp8 = PlanRequest(precision="fp8")
    u, bare = trainer_profile(p, fp8).units[1], trainer_profile(bare_p, fp8).units[1]

    def measured(mode: str) -> float:
        prefix = "" if mode == "none" else f"{mode}_"
        return seq * sum(
            pr.torchtitan_compiled_bytes(a, f"float8_{prefix}{g}")
            - pr.torchtitan_compiled_bytes(a, f"{prefix}{g}")
            for g in ("forward", "backward")
        )

    def priced(mode: str, x: UnitProfile) -> float:
        t = x.forward_s + x.backward_s
        if mode == "selective":
            t += x.selective_recompute_s
        if mode == "full":
            t += x.forward_s + x.full_recompute_extra_s
        return t

    h, f = a.hidden, a.ffn
    assert measured("selective") - measured("none") == seq * (3 * h - 2 * f + 8)
    assert measured("full") - measured("none") == seq * (17 * h - 2 * f + 28)
    for mode in ("none", "selective", "full"):
        assert (priced(mode, u) - priced(mode, bare)) * mem == pytest.approx(
            measured(mode), rel=1e-9
        )


@pytest.mark.parametrize(
    "a", [pr.LLAMA31_8B, pr.LLAMA31_70B, pr.LLAMA31_405B], ids=lambda a: a.name
)
def test_compiled_bf16_full_ac_rerun_priced_as_measured(a: pr.Arch) -> None:
    """Under full AC the compiled bf16 block's forward and backward (its re-computation fused
    in) move ``8 h + 4 ffn + 8`` bytes per token fewer than a forward, the forward again and
    the backward without AC (the measured graphs of ``TORCHTITAN_COMPILED_BYTES_PER_TOKEN``,
    each checked against a fresh measurement above; 90,120 at 8B): the table
    ``TORCHTITAN_COMPILED_FULL_AC_SAVED_BYTES_PER_TOKEN`` holds it, a compiled torchtitan
    block's profile carries it as a negative ``full_recompute_extra_s`` (at the memory
    bandwidth the forward's element-wise bytes are priced at), so a checkpointed stage's
    re-run (``rec_prefix``) is that much less than its forward; an eager block's re-run is a
    forward; under FP8 the casts' own difference adds to it. Failed before (the re-run was
    priced as a forward: ``full_recompute_extra_s`` 0 in bf16)."""
    h, kv, f = a.hidden, a.kv_dim, a.ffn
    graphs = {
        g: pr.torchtitan_compiled_bytes(a, g)
        for g in ("forward", "backward", "full_forward", "full_backward")
    }
    saved = (
        2 * graphs["forward"]
        + graphs["backward"]
        - graphs["full_forward"]
        - graphs["full_backward"]
    )
    assert saved == 8 * h + 4 * f + 8 == -pr.torchtitan_full_recompute_extra_bytes(a)
    assert pr.TORCHTITAN_COMPILED_FULL_AC_SAVED_BYTES_PER_TOKEN == {"h": 8, "ffn": 4, "1": 8}
    if a is pr.LLAMA31_8B:
        assert saved == 90120 and kv == 1024
    spec = pr.get_device("H100-96GB-HBM2e-500W")
    mem = spec.memory_bandwidth_bytes_per_s * spec.memory_efficiency
    seq = 8192
    kw = dict(gemm_tokens=seq, selective="torchtitan", eager="torchtitan")
    p = pr.transformer_profile(a, seq, spec, compiled=True, **kw)
    block = p.units[1]
    assert block.full_recompute_extra_s * mem == pytest.approx(-seq * saved, rel=1e-12)
    assert p.units[0].full_recompute_extra_s == p.units[-1].full_recompute_extra_s == 0.0
    eager = pr.transformer_profile(a, seq, spec, compiled=False, **kw).units[1]
    assert eager.full_recompute_extra_s == 0.0
    # the cost model's re-run of a checkpointed stage: the forward less the saved bytes
    costs = CostModel(
        p,
        Cluster([Device("h100", 10**12, 1.0)]),
        batch_size=p.batch_size,
        microbatches=1,
        schedule="1f1b",
        checkpoint="always",
        state_bytes_per_parameter=16,
        headroom=0.1,
    )
    rerun = costs.rec_prefix[2] - costs.rec_prefix[1]
    forward = costs.fwd_prefix[2] - costs.fwd_prefix[1]
    assert (forward - rerun) * mem == pytest.approx(seq * saved, rel=1e-9)
    # under FP8 the casts' difference (5 ffn - 12 fewer than a forward's casts) adds
    fp8 = trainer_profile(p, PlanRequest(precision="fp8")).units[1]
    casts = (5 * f - 12) * seq / mem
    assert fp8.full_recompute_extra_s == pytest.approx(block.full_recompute_extra_s - casts)
