"""The measured bytes of torchtitan's eager Llama block (benchmarks/eager_block_bytes.py)
against the table the published-runs benchmark prices with
(``published_runs.TORCHTITAN_EAGER_BYTES_PER_TOKEN``), at a shape the table was not read
from, and the dispatch-level rule of what moves bytes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import compiled_block_bytes as cb  # noqa: E402
import eager_block_bytes as eb  # noqa: E402
import published_runs as pr  # noqa: E402

FRESH = (192, 6, 2, 384)
"""(dim, heads, kv_heads, ffn): head dim 32, kv 64; in none of ``FIT_SHAPES``."""


@pytest.mark.parametrize("ac", cb.AC_MODES)
def test_table_matches_a_fresh_measurement(ac: str) -> None:
    """Running the block eagerly at :data:`FRESH` (a second or so) gives the table's bytes per
    token exactly, forward and backward, for each activation checkpointing mode."""
    assert FRESH not in cb.FIT_SHAPES
    fwd, bwd = eb.bytes_per_token(*FRESH, ac=ac)
    prefix = "" if ac == "none" else f"{ac}_"
    a = pr.Arch("fresh", 1, *FRESH, 1024, gated=True)
    assert fwd == pr.torchtitan_eager_bytes(a, f"{prefix}forward")
    assert bwd == pr.torchtitan_eager_bytes(a, f"{prefix}backward")


@pytest.mark.parametrize("ac", cb.AC_MODES)
def test_fused_norm_table_matches_a_fresh_measurement(ac: str) -> None:
    """The block with torchtitan's ``fused_rmsnorm`` kernels (each counted once) at
    :data:`FRESH` gives ``TORCHTITAN_FUSED_NORM_EAGER_BYTES_PER_TOKEN`` exactly."""
    fwd, bwd = eb.bytes_per_token(*FRESH, ac=ac, norm="fused")
    prefix = "" if ac == "none" else f"{ac}_"
    a = pr.Arch("fresh", 1, *FRESH, 1024, gated=True)
    assert fwd == pr.torchtitan_eager_bytes(a, f"{prefix}forward", norm="fused")
    assert bwd == pr.torchtitan_eager_bytes(a, f"{prefix}backward", norm="fused")


def test_fused_norm_moves_one_kernels_bytes() -> None:
    """One fused RMSNorm over ``[tokens, h]`` bf16: forward reads x and the weight, writes y and
    the fp32 per-row ``rstd`` (2 + 2 per element, 4 per row, the weight once); backward reads
    dy, x, the weight and ``rstd`` and writes dx; the gradients equal the eager norm's."""
    import megatron_block_bytes as mb

    torch.manual_seed(0)
    norm = cb._RMSNorm(64).to(torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    ref = norm(x)
    (gx_ref,) = torch.autograd.grad(ref.float().square().sum(), x)
    x2 = x.detach().requires_grad_()
    with mb.FusedBytes() as fwd:
        y = eb._FusedRMSNorm.apply(x2, norm.weight, norm.eps)
    assert dict(fwd.by_op) == {"fused_rms_norm": 32 * 64 * 4 + 64 * 2 + 32 * 4}
    torch.testing.assert_close(y, ref)
    with mb.FusedBytes() as bwd:
        (gx,) = torch.autograd.grad(y.float().square().sum(), x2)
    assert bwd.by_op["fused_rms_norm_backward"] == 32 * 64 * 6 + 64 * 2 + 32 * 4
    torch.testing.assert_close(gx, gx_ref, rtol=2e-2, atol=2e-2)


def _counted(fn: object) -> dict[str, int]:
    with eb.OpBytes() as mode:
        fn()  # type: ignore[operator]
    return dict(mode.by_op)


def test_views_move_nothing_and_copies_and_in_place_ops_do() -> None:
    """A view (``t``, ``transpose``, a ``reshape`` that views, ``expand``) moves no bytes; a
    ``reshape`` of a transposed matrix copies it (a ``clone``: 32 bytes read, 32 written); a
    ``reshape`` that must copy is a ``clone`` reading the broadcast input at its own size (8 x 2
    bf16 elements, 32 bytes) and writing the whole (8 x 4 x 2, 128 bytes); an in-place add
    reads both operands and writes the mutated one (3 x 64 x 4 bytes); a matmul is priced
    elsewhere; ``empty`` allocates without a kernel."""
    x = torch.randn(8, 2, dtype=torch.bfloat16)
    y = torch.randn(64)
    z = torch.randn(64)
    assert _counted(lambda: x.reshape(16).view(2, 8).t().transpose(0, 1)) == {}
    assert _counted(lambda: x.t().reshape(16)) == {"clone": 2 * 16 * 2}
    assert _counted(lambda: x.unsqueeze(1).expand(8, 4, 2).reshape(64)) == {"clone": 32 + 128}
    assert _counted(lambda: y.add_(z)) == {"add_": 3 * 64 * 4}
    assert _counted(lambda: x @ x.t()) == {}
    assert _counted(lambda: torch.empty(64)) == {}


def test_llama_8b_eager_bytes_by_hand() -> None:
    """Llama 3.1 8B (h 4096, kv 1024, ffn 14336, 32 heads of 128): forward 108 h + 24 kv + 10
    ffn + 8 head_dim + 48 = 611,376 bytes per token (the hand count before: 626,688, with the
    attention output's ``.contiguous()`` as a 4 h copy), backward 1,260,624 (assumed twice the
    forward, 1,253,376); torchtitan's selective AC re-computes 586,800 (assumed one forward). A
    torchtitan eager run's profile carries the difference from the generic unfused count
    (360,448 forward) at the H100's memory bandwidth."""
    a = pr.LLAMA31_8B
    fwd = pr.torchtitan_eager_bytes(a, "forward")
    bwd = pr.torchtitan_eager_bytes(a, "backward")
    assert fwd == 108 * 4096 + 24 * 1024 + 10 * 14336 + 8 * 128 + 48 == 611376
    assert bwd == 238 * 4096 + 24 * 1024 + 18 * 14336 + 24 * 128 + 80 == 1260624
    redo = (
        pr.torchtitan_eager_bytes(a, "selective_forward")
        + pr.torchtitan_eager_bytes(a, "selective_backward")
        - fwd
        - bwd
    )
    assert redo == 102 * 4096 + 24 * 1024 + 10 * 14336 + 8 * 128 + 48 == 586800
    generic = pr.BF16 * pr._elementwise_elements(a, compiled=False)
    assert generic == 360448
    spec = pr.get_device("H100-96GB-HBM2e-500W")
    seq = 8192
    kw = dict(gemm_tokens=seq, selective="torchtitan")
    tt = pr.transformer_profile(a, seq, spec, eager="torchtitan", **kw).units[1]
    gen = pr.transformer_profile(a, seq, spec, **kw).units[1]
    mem = spec.memory_bandwidth_bytes_per_s * spec.memory_efficiency
    assert tt.forward_s - gen.forward_s == pytest.approx(seq * (fwd - generic) / mem)
    assert tt.backward_s - gen.backward_s == pytest.approx(seq * (bwd - 2 * generic) / mem)
    assert tt.selective_recompute_s - gen.selective_recompute_s == pytest.approx(
        seq * (redo - generic) / mem
    )
    # the benchmark's eager torchtitan rows are priced so: the table's figures at their micro-batch
    run = next(r for r in pr.RUNS if r.key == "tt-8b-8gpu")
    assert not run.compiled and run.microbatch == 2
    block = pr.profile_of(run).units[1]
    kw["gemm_tokens"] = 2 * seq
    tt = pr.transformer_profile(a, seq, spec, eager="torchtitan", **kw).units[1]
    gen = pr.transformer_profile(a, seq, spec, **kw).units[1]
    for field in ("forward_s", "backward_s", "selective_recompute_s"):
        assert getattr(block, field) == pytest.approx(getattr(tt, field))
        assert getattr(block, field) != pytest.approx(getattr(gen, field))


def test_float8_fsdp_weight_casts_measured() -> None:
    """torchtitan's float8 FSDP recipe casts each rank's fp32 weight shard in torchao's
    ``fsdp_pre_all_gather``, eagerly: 21 bytes per shard element per all-gather (the scale's
    ``mul`` 8, ``clamp`` 8, the FP8 copy 5, not the one fused read-and-write of 5 assumed
    before), and its amax 4 per step: what ``published_runs`` puts in the blocks'
    ``fp8_gather_cast_bytes`` / ``fp8_weight_amax_bytes``. A few seconds."""
    pytest.importorskip("torchao")
    gather, step, ops = eb.fsdp_float8_weight_bytes()
    assert (gather, step) == (21, 4)
    assert set(ops) == {"mul", "clamp", "_to_copy"}
    assert pr.TORCHTITAN_FSDP_FLOAT8_WEIGHT_BYTES == {"all_gather": gather, "step": step}
    spec = pr.get_device("H100-96GB-HBM2e-500W")
    a = pr.LLAMA31_8B
    block = pr.transformer_profile(
        a, 8192, spec, compiled=True, eager="torchtitan", selective="torchtitan"
    ).units[1]
    weights = a.block_parameters - 2 * a.hidden
    assert block.fp8_gather_cast_bytes == 21 * weights
    assert block.fp8_weight_amax_bytes == 4 * weights
