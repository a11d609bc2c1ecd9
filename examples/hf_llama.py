"""A Hugging Face Llama, built from its config (random weights: nothing is downloaded).

``build_model`` is a tiny Llama (4 layers, hidden 64) that plans and trains in seconds on a
CPU; the published Llama-2 shapes are named factories, for planning on GPUs you don't have
(``--device`` counts them on the meta device, no weights allocated):

    autopipe plan examples/hf_llama.py --gpus 4
    autopipe plan examples/hf_llama.py:llama2_7b --gpus 8 --device h100
    autopipe plan examples/hf_llama.py:llama2_70b --gpus 32 --device h100 --optimizer adam

The inputs carry ``labels``, so the model returns its own next-token loss, which autopipe
weights by the labelled tokens of each micro-batch.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config needs no hub; make sure none is asked

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def _llama(seq_len: int, **shape: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        max_position_embeddings=seq_len,
        use_cache=False,  # training: no key/value cache
        attn_implementation="sdpa",
        **shape,
    )
    torch.manual_seed(0)  # every rank of `autopipe run` builds the same weights
    return LlamaForCausalLM(config)


TINY_SEQ_LEN = 64


def build_model() -> LlamaForCausalLM:
    """A tiny Llama: 4 layers, hidden 64, vocabulary 1024 (about 0.3 M parameters)."""
    return _llama(
        TINY_SEQ_LEN, vocab_size=1024, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip


def example_inputs(batch_size: int = 8) -> dict[str, torch.Tensor]:
    """Token ids and labels, (batch_size, 64) int64 each."""
    return _tokens(batch_size, TINY_SEQ_LEN, vocab_size=1024)


# Llama-2's published shapes: vocabulary 32000, sequence length 4096.
LLAMA2_SEQ_LEN = 4096


def llama2_7b() -> LlamaForCausalLM:
    """Llama-2-7B: 32 layers, hidden 4096, MLP 11008, 32 heads (6.7 B parameters)."""
    return _llama(
        LLAMA2_SEQ_LEN, vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    )  # fmt: skip


def llama2_13b() -> LlamaForCausalLM:
    """Llama-2-13B: 40 layers, hidden 5120, MLP 13824, 40 heads (13 B parameters)."""
    return _llama(
        LLAMA2_SEQ_LEN, vocab_size=32000, hidden_size=5120, intermediate_size=13824,
        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
    )  # fmt: skip


def llama2_70b() -> LlamaForCausalLM:
    """Llama-2-70B: 80 layers, hidden 8192, MLP 28672, 64 heads, 8 key/value heads (69 B)."""
    return _llama(
        LLAMA2_SEQ_LEN, vocab_size=32000, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
    )  # fmt: skip


def _llama2_inputs(batch_size: int = 8) -> dict[str, torch.Tensor]:
    """Token ids and labels, (batch_size, 4096) int64 each."""
    return _tokens(batch_size, LLAMA2_SEQ_LEN, vocab_size=32000)


example_inputs_llama2_7b = example_inputs_llama2_13b = example_inputs_llama2_70b = _llama2_inputs


def _tokens(batch_size: int, seq_len: int, vocab_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
