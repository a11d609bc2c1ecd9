"""Hugging Face Llama-2 configurations built from their configs (random weights, no download).

Build them on the meta device (``autopipe plan ... --device h100``) unless you have the memory:

    autopipe plan benchmarks/models/hf_llama.py:llama2_7b --gpus 8 --device h100
    autopipe plan benchmarks/models/hf_llama.py:llama2_70b --gpus 16 --device h100

The shapes are Llama-2's published ones (7B: 32 layers, hidden 4096, MLP 11008, 32 heads;
70B: 80 layers, hidden 8192, MLP 28672, 64 heads with 8 key/value heads), vocabulary 32000,
sequence length 4096.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

SEQ_LEN = 4096
VOCAB = 32000
LLAMA3_SEQ_LEN = 8192
LLAMA3_VOCAB = 128256


def _config(**shape: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        max_position_embeddings=SEQ_LEN,
        use_cache=False,
        attn_implementation="sdpa",
        **shape,
    )


def llama2_7b() -> LlamaForCausalLM:
    """6.7 B parameters."""
    return LlamaForCausalLM(
        _config(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32)
    )  # fmt: skip


def llama2_70b() -> LlamaForCausalLM:
    """69 B parameters."""
    return LlamaForCausalLM(
        _config(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8)
    )  # fmt: skip


def llama31_405b() -> LlamaForCausalLM:
    """A Llama-3.1-405B-like config: 126 layers, hidden 16384, MLP 53248, 128 heads with 8
    key/value heads, vocabulary 128256, sequence 8192 (406 B parameters)."""
    config = LlamaConfig(
        vocab_size=LLAMA3_VOCAB,
        max_position_embeddings=LLAMA3_SEQ_LEN,
        use_cache=False,
        attn_implementation="sdpa",
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        rope_theta=500000.0,
    )
    return LlamaForCausalLM(config)


def example_inputs_llama31_405b(batch_size: int = 8) -> dict[str, torch.Tensor]:
    """Token ids (batch, 8192) int64 for :func:`llama31_405b`."""
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, LLAMA3_VOCAB, (batch_size, LLAMA3_SEQ_LEN), generator=g)}


def example_inputs(batch_size: int = 8) -> dict[str, torch.Tensor]:
    """Token ids (batch, 4096) int64; the model's loss is the sum of its logits."""
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=g)}


build_model = llama2_7b
