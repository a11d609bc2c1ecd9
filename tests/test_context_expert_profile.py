"""The facts context and expert parallelism are priced from (issue 35): the profiler records
per unit the attention layers (heads, key/value heads, head sizes) and the MoE layers (routed
experts, top-k, expert parameters, hidden size), and the sequence length; older profiles
without them still load."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only, nothing downloads

import json

import pytest
import torch
from autopipe.profiler.analytic import profile_analytic
from autopipe.profiler.options import AnalyticOptions

from autopipe.core.profile import Profile

transformers = pytest.importorskip("transformers")
IDS = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}


def _count(build) -> Profile:  # noqa: ANN001
    return profile_analytic(build, IDS, "h100", AnalyticOptions(microbatch_sizes=()))


def test_mixtral_layers_record_attention_and_experts() -> None:
    cfg = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, use_cache=False, max_position_embeddings=64,
    )  # fmt: skip
    p = _count(lambda: transformers.MixtralForCausalLM(cfg))
    assert p.sequence_length == 16
    layer = p.units[p.unit_names.index("model.layers.1")]
    assert (layer.attention_layers, layer.attention_heads, layer.attention_kv_heads) == (1, 4, 2)
    assert (layer.attention_head_dim, layer.attention_value_head_dim) == (16, 16)
    assert (layer.moe_layers, layer.moe_experts, layer.moe_top_k) == (1, 4, 2)
    # gate_up (E x 2F x H) and down (E x H x F): 3 H F per expert
    assert layer.moe_expert_parameter_count == 4 * 3 * 64 * 96
    assert layer.moe_hidden_size == 64
    embed = p.units[0]
    assert embed.attention_layers == 0 and embed.moe_layers == 0


def test_deepseek_v3_records_mla_heads_and_only_routed_experts() -> None:
    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, use_cache=False, max_position_embeddings=64,
    )  # fmt: skip
    p = _count(lambda: transformers.DeepseekV3ForCausalLM(cfg))
    dense = p.units[p.unit_names.index("model.layers.0")]
    moe = p.units[p.unit_names.index("model.layers.2")]
    assert dense.moe_layers == 0 and dense.attention_layers == 1
    assert (moe.attention_heads, moe.attention_kv_heads) == (4, 4)
    assert (moe.attention_head_dim, moe.attention_value_head_dim) == (24, 12)
    assert (moe.moe_layers, moe.moe_experts, moe.moe_top_k) == (1, 8, 2)
    assert moe.moe_expert_parameter_count == 8 * 3 * 64 * 32  # the shared expert is dense
    assert moe.moe_expert_parameter_count < moe.parameter_count


def test_a_profile_written_before_the_fields_loads_without_them(tmp_path) -> None:  # noqa: ANN001
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    p = _count(lambda: transformers.LlamaForCausalLM(cfg))
    layer = p.units[p.unit_names.index("model.layers.0")]
    assert layer.attention_layers == 1 and layer.moe_layers == 0
    data = p.to_dict()
    data.pop("sequence_length")
    for u in data["units"]:
        for key in [k for k in u if k.startswith(("attention_", "moe_"))]:
            del u[key]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = Profile.load(path)
    assert old.sequence_length == 0 and all(u.attention_layers == 0 for u in old.units)
