"""The mesh zoo's models: Hugging Face causal LMs that carry a tensor-parallel plan, built from
tiny configs (random weights, seeded, nothing downloaded), for tests/test_mesh_zoo.py.

Each family is one entry of :data:`FAMILIES`: a builder returning the model (same weights in
every process: ``torch.manual_seed(0)`` first) with dropout off. :func:`example_inputs`
gives seeded token ids for a family's vocabulary. Sizes are the smallest that keep every
family's TP plan valid at T = 2 (4 query heads, 2 key/value heads, hidden 32) and give a
pipeline of 2 x 2 chunks something to cut (2 decoder layers). Not a test module (no
``test_`` prefix).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: never reach for a hub

SEQ = 8
VOCAB = 128
BIG_VOCAB = 8192
"""The large-vocabulary Llama's: its head outweighs both layers (8192 x 32 against ~10 k
parameters a layer), so a 2-stage plan cuts right before it."""
HIDDEN = 32


def _common(vocab: int = VOCAB) -> dict[str, Any]:
    return {
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4 * SEQ,
        "use_cache": False,
        "attention_dropout": 0.0,
    }


def _build(config_class: str, model_class: str, **fields: Any) -> nn.Module:
    import transformers

    config = getattr(transformers, config_class)(**{**_common(), **fields})
    torch.manual_seed(0)
    model: nn.Module = getattr(transformers, model_class)(config)
    return model


def llama() -> nn.Module:
    return _build("LlamaConfig", "LlamaForCausalLM")


def llama_tied() -> nn.Module:
    """The LM head shares the token embedding's weight."""
    return _build("LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=True)


def llama_big_vocab() -> nn.Module:
    return _build("LlamaConfig", "LlamaForCausalLM", vocab_size=BIG_VOCAB)


def mistral() -> nn.Module:
    return _build("MistralConfig", "MistralForCausalLM", sliding_window=None)


def qwen2() -> nn.Module:
    return _build("Qwen2Config", "Qwen2ForCausalLM")


def qwen3() -> nn.Module:
    """Per-head RMSNorms on q and k (``q_norm``, ``k_norm``): replicated under TP."""
    return _build("Qwen3Config", "Qwen3ForCausalLM", head_dim=8)


def granite() -> nn.Module:
    return _build("GraniteConfig", "GraniteForCausalLM")


def olmo2() -> nn.Module:
    """q/k norms over the whole projection; its plan gathers q, k, v (``rowwise_split_input``)."""
    return _build("Olmo2Config", "Olmo2ForCausalLM")


def phi3() -> nn.Module:
    """Fused qkv and gate-up projections, ``colwise_gather_output`` / ``rowwise_split_input``."""
    return _build("Phi3Config", "Phi3ForCausalLM", resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0)


def glm4() -> nn.Module:
    """Sandwich norms around attention and MLP, a fused gate-up projection."""
    return _build("Glm4Config", "Glm4ForCausalLM", head_dim=8, pad_token_id=0)


def gemma2() -> nn.Module:
    """Sandwich norms (pre and post feed-forward), soft-capped logits, tied head."""
    return _build(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=4,
    )


def gemma3() -> nn.Module:
    """Sandwich norms and per-head q/k norms, tied head."""
    return _build(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=4,
    )


def cohere_qk_norm() -> nn.Module:
    """Parallel attention and MLP off one LayerNorm, with per-head q/k LayerNorms."""
    return _build("CohereConfig", "CohereForCausalLM", use_qk_norm=True)


BATCHED_EXPERTS = {"experts_implementation": "batched_mm"}
"""Mixture-of-experts layers as one batched matmul over each token's experts: transformers'
default ``grouped_mm`` has no float64 kernel on the CPU, and the zoo trains in float64
(tests/mesh_zoo_run.py ``DTYPE``); ``eager`` (a loop over the experts hit) does not trace."""


def mixtral() -> nn.Module:
    """Mixture of experts (4 experts, 2 per token); the plan splits attention only."""
    return _build(
        "MixtralConfig",
        "MixtralForCausalLM",
        **BATCHED_EXPERTS,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
    )


def qwen3_moe() -> nn.Module:
    """Qwen3's q/k norms with mixture-of-experts MLPs in every layer."""
    return _build(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        **BATCHED_EXPERTS,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def deepseek_v3() -> nn.Module:
    """Multi-head latent attention (MLA), one dense layer then shared + routed experts."""
    return _build(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        **BATCHED_EXPERTS,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        moe_intermediate_size=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
    )


def starcoder2() -> nn.Module:
    """LayerNorms with biases, a plain (non-gated) MLP ``c_fc`` / ``c_proj``."""
    return _build(
        "Starcoder2Config", "Starcoder2ForCausalLM", residual_dropout=0.0, embedding_dropout=0.0
    )


def olmo() -> nn.Module:
    """OLMo's weightless LayerNorm."""
    return _build("OlmoConfig", "OlmoForCausalLM")


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "llama": llama,
    "llama_tied": llama_tied,
    "llama_big_vocab": llama_big_vocab,
    "mistral": mistral,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "granite": granite,
    "olmo": olmo,
    "olmo2": olmo2,
    "phi3": phi3,
    "glm4": glm4,
    "gemma2": gemma2,
    "gemma3": gemma3,
    "cohere_qk_norm": cohere_qk_norm,
    "starcoder2": starcoder2,
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "deepseek_v3": deepseek_v3,
}
"""Family name -> builder. Every one carries a Hugging Face ``base_model_tp_plan``."""


def vocab_of(family: str) -> int:
    return BIG_VOCAB if family == "llama_big_vocab" else VOCAB


def build(family: str, dtype: str = "float32") -> nn.Module:
    """The family's model, seeded, its parameters and buffers in ``dtype`` (a torch dtype's name)."""
    return FAMILIES[family]().to(getattr(torch, dtype))


def example_inputs(family: str, batch_size: int) -> dict[str, torch.Tensor]:
    """Seeded token ids ``[batch_size, SEQ]`` within the family's vocabulary."""
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, vocab_of(family), (batch_size, SEQ), generator=g)}
