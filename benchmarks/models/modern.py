"""Two published large-model shapes for the modern-mesh figures (benchmarks/modern_mesh.py),
as Hugging Face models built on the meta device (random weights, nothing downloaded).

- DeepSeek-V3 (DeepSeek-V3 technical report, arXiv 2412.19437, and its published config):
  61 layers (the first 3 dense), hidden 7168, 128 heads of multi-head latent attention (query
  rank 1536, key/value rank 512, key head 128 + 64 rotary, value head 128), 256 routed
  experts of width 2048 plus 1 shared expert, top-8 in 8 groups (4 chosen), dense MLP 18432,
  vocabulary 129280, sequence 4096: 671 B parameters.
- Llama 3 405B (The Llama 3 Herd of Models, arXiv 2407.21783): 126 layers, hidden 16384, MLP
  53248, 128 heads with 8 key/value heads, vocabulary 128256, at 128K (131072) tokens, the
  long-context stage it was trained with CP 16.
"""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import (  # noqa: E402
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

DEEPSEEK_SEQ = 4096
LLAMA_128K = 131072


def deepseek_v3() -> DeepseekV3ForCausalLM:
    config = DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, use_cache=False,
        max_position_embeddings=DEEPSEEK_SEQ, tie_word_embeddings=False,
    )  # fmt: skip
    return DeepseekV3ForCausalLM(config)


def example_inputs_deepseek_v3(batch_size: int = 8) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.zeros(batch_size, DEEPSEEK_SEQ, dtype=torch.long)}


def llama3_405b_128k() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=128256, max_position_embeddings=LLAMA_128K, use_cache=False,
        attn_implementation="sdpa", hidden_size=16384, intermediate_size=53248,
        num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
        rope_theta=500000.0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def example_inputs_llama3_405b_128k(batch_size: int = 1) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.zeros(batch_size, LLAMA_128K, dtype=torch.long)}
