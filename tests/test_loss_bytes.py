"""The trainers' cross-entropy losses, counted op by op (benchmarks/loss_bytes.py), against
the table the published-runs benchmark prices the head with
(``published_runs.LOSS_BYTES_PER_LOGIT``), and the head priced with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import published_runs as pr  # noqa: E402


def test_table_matches_a_fresh_count() -> None:
    """torch's loss, torch's loss-parallel loss and Megatron-Core's vocab-parallel loss, each
    run on bf16 logits in a process of its own (a gloo group of one for the TP group), move
    the table's bytes per logit exactly, forward and backward."""
    pytest.importorskip("megatron.core")
    out = subprocess.run(
        [sys.executable, str(BENCH / "loss_bytes.py"), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=BENCH,
    )
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert {k: tuple(v) for k, v in measured.items()} == pr.LOSS_BYTES_PER_LOGIT


@pytest.mark.parametrize("loss", sorted(pr.LOSS_BYTES_PER_LOGIT))
def test_the_head_prices_its_loss_as_counted(loss: str) -> None:
    """The closed-form head's element-wise time is the loss's counted bytes per logit at the
    GPU's sustained bandwidth, forward and backward (not one count for every trainer)."""
    run = next(r for r in pr.RUNS if r.key == "mcore-1.7b")
    spec = pr.get_device(run.gpu)
    price = pr.pricing_for(spec)
    profile = pr.transformer_profile(run.arch, run.seq, spec, loss=loss, pricing=price)
    head = profile.units[-1]
    logits = profile.batch_size * run.seq * run.arch.vocab
    head_mm = logits * 2 * run.arch.hidden / price.matmul_flops_per_s
    fwd, bwd = pr.LOSS_BYTES_PER_LOGIT[loss]
    assert head.forward_s == pytest.approx(head_mm + logits * fwd / price.memory_bytes_per_s)
    assert head.backward_s == pytest.approx(2 * head_mm + logits * bwd / price.memory_bytes_per_s)
