"""planner/emit_torchtitan.py: unit names in torchtitan's terms, per torchtitan version."""

from __future__ import annotations

import pytest
from autopipe.planner.emit_common import EmitError
from autopipe.planner.emit_torchtitan import (
    TORCHTITAN_PYTHON_VERSION,
    TORCHTITAN_SCHEDULES,
    TORCHTITAN_VERSION,
    torchtitan_names,
)

from autopipe.core.vocabulary import PLAN_SCHEDULES

HF_LLAMA = ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1",
            "model.norm", "lm_head"]  # fmt: skip


def test_hugging_face_llama_names_map_to_torchtitans_llama_per_version() -> None:
    names, note = torchtitan_names(HF_LLAMA)
    assert names == ["tok_embeddings", None, "layers.0", "layers.1", "norm", "output"]
    assert note.startswith(f"Hugging Face Llama names mapped to torchtitan {TORCHTITAN_VERSION}")
    names, _ = torchtitan_names(HF_LLAMA, TORCHTITAN_PYTHON_VERSION)
    assert names[-1] == "lm_head"  # 0.3.0 calls the head lm_head


def test_top_level_names_pass_through() -> None:
    units = ["tok_emb", "blocks.0", "blocks.1", "head"]
    assert torchtitan_names(units) == (units, "")


@pytest.mark.parametrize(
    ("units", "message"),
    [
        (["embed", "blocks.0.attn", "head"], "unit 'blocks.0.attn' is not a top-level module"),
        (["embed", "encoder.norm", "head"], "unit 'encoder.norm' is not a top-level module"),
        (
            ["model.embed_tokens", "model.layers.0", "model.extra", "model.norm", "lm_head"],
            "unit 'model.extra' has no counterpart in torchtitan's Llama-like models",
        ),
        (
            ["model.embed_tokens", "model.layers.0", "lm_head"],
            "the model's units lack norm of torchtitan's Llama-like models",
        ),
    ],
)
def test_names_torchtitan_would_drop_are_refused(units: list[str], message: str) -> None:
    with pytest.raises(EmitError) as info:
        torchtitan_names(units)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_every_schedule_has_its_torch_class_name() -> None:
    assert list(TORCHTITAN_SCHEDULES) == list(PLAN_SCHEDULES)
    assert TORCHTITAN_SCHEDULES["1f1b"] == "1F1B" and TORCHTITAN_SCHEDULES["zbv"] == "ZBVZeroBubble"
