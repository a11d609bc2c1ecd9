"""The measured bytes of torchtitan's compiled Llama block (benchmarks/compiled_block_bytes.py)
against the formula the published-runs benchmark prices with
(``published_runs.TORCHTITAN_COMPILED_BYTES_PER_TOKEN``), at a shape the formula was not read
from."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

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
