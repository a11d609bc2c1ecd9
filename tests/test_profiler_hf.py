"""A Hugging Face GPT-2 (small config, no cache) through the tracer chain and profiler.

Skipped when ``transformers`` is not installed (it is not a dependency). Verified by hand
with transformers 5.24 on torch 2.13: fx fails on GPT-2, export traces it.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autopipe.profiler.measure import profile  # noqa: E402
from autopipe.profiler.options import MeasureOptions  # noqa: E402


def test_gpt2_export_units_tied_head_and_bytes() -> None:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=256,
        n_positions=32,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 256, (2, 16))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    p = profile(
        model,
        inputs,
        MeasureOptions(warmup=0, repeat=1, microbatch_sizes=(), reference=True),
        progress=False,
    )
    assert p.tracer == "export"
    assert p.unit_names == [
        "transformer.wte",
        "transformer.wpe",
        "transformer.drop",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.ln_f",
        "lm_head",
    ]
    assert p.parameter_bytes_total == sum(q.numel() * 4 for q in model.parameters())
    assert (
        p.units[0].shared_parameters == p.units[-1].shared_parameters == ["transformer.wte.weight"]
    )
    saved = sum(u.activation_bytes for u in p.units)
    assert saved == pytest.approx(p.total_activation_bytes, rel=0.05)
    # Conv1D's addmm and the tied head's matmul are weight matmuls (what FP8 prices), per
    # token 2 x 12 d^2 per block and 2 x d x vocab for the head: 32 tokens
    tokens = 2 * 16
    assert [u.linear_forward_flops for u in p.units] == [
        0, 0, 0, 2 * tokens * 12 * 64 * 64, 2 * tokens * 12 * 64 * 64, 0, 2 * tokens * 64 * 256
    ]  # fmt: skip
