"""Hugging Face families whose TP plans leave parameters replicated inside a split region
(tests/test_tp_gradients.py), as a model file: tiny configs (4 heads, 2 key/value heads: T = 2
divides both), random seeded weights, no download; seeded inputs and the default objective
(the model's own next-token loss). Not a test module (no ``test_`` prefix).

- ``qwen3``, ``apertus``: per-head ``q_norm`` / ``k_norm`` after the column-wise q/k
  projections (Apertus adds xIELU, an activation with learnable scalars, in its MLP);
- ``phi3``, ``glm``, ``glm4``, ``olmo2``: ``rowwise_split_input`` in their plans (the
  input arrives whole);
- ``olmo``: a plain plan (nothing replicated inside a split region);
- ``llama_tied``: a Llama whose LM head is tied to its embedding;
- ``cohere_qk_norm``: per-head q/k norm weights ``[heads, head_dim]``, split with the heads;
- ``gemma2``: a tied head and a scaled embedding (its ``embed_scale`` buffer is read by the
  graph after the lookup, outside the split embedding's forward).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import zoo  # the model file's folder is on sys.path while it loads
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: never reach for a hub

SEQ = zoo.SEQ
VOCAB = zoo.VOCAB
FAMILIES = ("qwen3", "apertus", "phi3", "glm", "glm4", "olmo2", "olmo")


def _decoder(cls_name: str, model_name: str, **extra: Any) -> nn.Module:
    """``model_name`` on the zoo's tiny decoder config (:func:`zoo.decoder_config`), seeded."""
    import transformers

    config = zoo.decoder_config(cls_name, **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config)


def _inputs(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def qwen3() -> nn.Module:
    return _decoder("Qwen3Config", "Qwen3ForCausalLM", head_dim=8, tie_word_embeddings=False)


def apertus() -> nn.Module:
    return _decoder("ApertusConfig", "ApertusForCausalLM", tie_word_embeddings=False)


def phi3() -> nn.Module:
    return _decoder(
        "Phi3Config", "Phi3ForCausalLM", tie_word_embeddings=False, pad_token_id=0, eos_token_id=1
    )


def glm() -> nn.Module:
    return _decoder(
        "GlmConfig",
        "GlmForCausalLM",
        tie_word_embeddings=False,
        head_dim=8,
        pad_token_id=0,
        eos_token_id=1,
    )


def glm4() -> nn.Module:
    return _decoder(
        "Glm4Config",
        "Glm4ForCausalLM",
        tie_word_embeddings=False,
        head_dim=8,
        pad_token_id=0,
        eos_token_id=1,
    )


def olmo2() -> nn.Module:
    return _decoder("Olmo2Config", "Olmo2ForCausalLM", tie_word_embeddings=False, pad_token_id=0)


def olmo() -> nn.Module:
    return _decoder("OlmoConfig", "OlmoForCausalLM", tie_word_embeddings=False, pad_token_id=0)


def llama_tied() -> nn.Module:
    return _decoder("LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=True)


def gemma2() -> nn.Module:
    return _decoder(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=4,
    )


def cohere_qk_norm() -> nn.Module:
    """Cohere's per-head q/k LayerNorms: weights ``[heads, head_dim]`` (4 query heads, 2
    key/value heads: one per TP rank at T = 2), a head tied to its embedding."""
    return _decoder(
        "CohereConfig", "CohereForCausalLM", use_qk_norm=True, pad_token_id=0, eos_token_id=1
    )


def _example(batch_size: int = 8) -> dict[str, torch.Tensor]:
    return _inputs(batch_size)


example_inputs_qwen3 = example_inputs_apertus = example_inputs_phi3 = _example
example_inputs_glm = example_inputs_glm4 = example_inputs_olmo2 = _example
example_inputs_olmo = example_inputs_llama_tied = example_inputs_gemma2 = _example
