"""Megatron-Core's GPT layer counted with its fused kernels (benchmarks/megatron_block_bytes.py)
against the table the published-runs benchmark prices Megatron's runs with
(``published_runs.MEGATRON_FUSED_BYTES_PER_TOKEN``), and the runs priced with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import megatron_block_bytes as mb  # noqa: E402
import published_runs as pr  # noqa: E402


def test_table_matches_a_fresh_measurement_at_a_new_shape() -> None:
    """Megatron-Core's own layer (h 320, 8 heads, ffn 640: no fit shape), run in a process of
    its own (a gloo world of one) at 160 and 240 tokens (no fit length), moves per token what
    the table says at ``s = 160 + 240`` (the difference quotient of ``s A + B heads s^2``),
    each graph of both configurations, exactly."""
    pytest.importorskip("megatron.core")
    h, heads, ffn, s1, s2 = 320, 8, 640, 160, 240
    out = subprocess.run(
        [sys.executable, str(BENCH / "megatron_block_bytes.py"), "--pair",
         f"{h},{heads},{ffn},{s1},{s2}"],
        capture_output=True, text=True, timeout=300, check=True, cwd=BENCH,
    )  # fmt: skip
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    a = pr.Arch("probe", 1, h, heads, heads, ffn, 1024, gated=False)
    expected = {
        c: {g: pr.megatron_fused_bytes(a, s1 + s2, f"{c}_{g}") for g in mb.GRAPHS}
        for c in mb.CONFIGS
    }
    assert measured == expected
    # the attention scores' terms grow with the sequence: sc21 moves more than mcore
    assert (
        measured["sc21"]["forward"] - measured["mcore"]["forward"]
        == 6 * h + 8 * heads * (s1 + s2) + 4 * heads
    )


def test_the_causal_softmax_kernel_reads_up_to_the_diagonal() -> None:
    """Megatron's causal softmax kernel loads row ``i`` of a head's scores up to its diagonal:
    whole 4-element loads above 64 keys (``s (s + 4) / 2`` elements for ``s`` a multiple of 4),
    single elements below (``s (s + 1) / 2``); its launch puts 4 rows a block above 128 keys,
    8 at 128 and below."""
    assert mb.causal_read_elements(144) == 144 * 148 // 2
    assert mb.causal_read_elements(2048) == 2048 * 2052 // 2
    assert mb.causal_read_elements(32) == 32 * 33 // 2
    assert mb._batch_per_block(2048, 2048, 1, 16) == 4
    assert mb._batch_per_block(128, 128, 1, 16) == 8


def test_megatron_runs_are_priced_with_the_measured_layer() -> None:
    """A Megatron run's block carries the measured fused bytes at the GPU's sustained
    bandwidth where the generic unfused count was (SC21 1.7B: h 2304, 24 heads, seq 2048:
    forward 38 h + 4 ffn + 8 heads s + 4 heads + 16 = 517,744 bytes per token against the generic
    86 h + 12 heads s = 787,968; backward 654,544 against 1,575,936); the benchmark's Megatron
    runs take it, a gated model has no measurement."""
    run = next(r for r in pr.RUNS if r.key == "sc21-1.7b")
    a, seq = run.arch, run.seq
    spec = pr.get_device(run.gpu)
    price = pr.pricing_for(spec)
    mem = price.memory_bytes_per_s
    fwd = pr.megatron_fused_bytes(a, seq, "sc21_forward")
    bwd = pr.megatron_fused_bytes(a, seq, "sc21_backward")
    assert (fwd, bwd) == (517744, 654544)
    generic_fwd = pr.BF16 * pr._elementwise_elements(a, compiled=False) + 12 * a.heads * seq
    assert generic_fwd == 787968
    kw = dict(flash=False, pricing=price)
    mg = pr.transformer_profile(a, seq, spec, eager="megatron", **kw).units[1]
    gen = pr.transformer_profile(a, seq, spec, **kw).units[1]
    assert mg.forward_s - gen.forward_s == pytest.approx(seq * (fwd - generic_fwd) / mem)
    assert mg.backward_s - gen.backward_s == pytest.approx(seq * (bwd - 2 * generic_fwd) / mem)
    # selective recompute re-runs the attention core's softmax and dropout: 8 heads s + 4 heads
    attn = seq * a.heads * (8 * seq + 4) / mem
    gen_attn = seq * 12 * a.heads * seq / mem
    assert mg.selective_recompute_s - gen.selective_recompute_s == pytest.approx(attn - gen_attn)
    for key in ("sc21-1.7b", "mcore-70b", "bloom-176b"):
        r = next(x for x in pr.RUNS if x.key == key)
        assert pr.profile_of(r).units[1].forward_s == pytest.approx(
            pr.transformer_profile(
                r.arch, r.seq, pr.get_device(r.gpu), flash=r.flash, eager="megatron",
                gemm_tokens=(r.microbatch or 1) * r.seq, tp=r.tp,
                attention_kernel=pr.kernel_for_trainer("megatron"),
            ).units[1].forward_s
        )  # fmt: skip
    with pytest.raises(ValueError, match="gated True"):
        pr.transformer_profile(pr.LLAMA31_8B, 8192, spec, eager="megatron")
