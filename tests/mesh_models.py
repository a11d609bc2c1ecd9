"""The models of the mesh tests (tests/test_distributed_mesh.py), as a model file:
a tiny Hugging Face Llama (4 heads, 2 KV heads: T = 2 divides both), a Cohere of the same
size (attention and MLP in parallel), post-norm blocks (:class:`PostNorm`) and
examples/gpt.py's GPT at a tiny size, each seeded, with seeded inputs and the default
objective. Not a test module (no ``test_`` prefix).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: never reach for a hub

SEQ = 8
VOCAB = 64
GPT_FILE = Path(__file__).resolve().parents[1] / "examples" / "gpt.py"


def _gpt_module() -> Any:
    name = "autopipe_example_gpt"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, GPT_FILE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _ids(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)


def llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * SEQ,
        use_cache=False,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def cohere() -> nn.Module:
    """A tiny Hugging Face Cohere: attention and MLP in parallel off one LayerNorm (no bias),
    a logit scale after the head; untied, so its plan's embedding is split too."""
    import transformers

    config = transformers.CohereConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * SEQ,
        use_cache=False,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.CohereForCausalLM(config)


def example_inputs_cohere(batch_size: int = 8) -> dict[str, torch.Tensor]:
    return example_inputs_llama(batch_size)


class PostNormBlock(nn.Module):
    """A post-norm MLP block (BERT's order): ``norm(x + down(gelu(up(x))))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(nn.functional.gelu(self.up(x))))


class PostNorm(nn.Module):
    """Post-norm blocks: a norm's output feeds the next block's split ``up`` and its
    residual, so under sequence parallelism it stays a shard and ``up`` gathers it."""

    _tp_plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise", "head": "colwise_rep"}

    def __init__(self, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(PostNormBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def postnorm() -> nn.Module:
    torch.manual_seed(0)
    return PostNorm()


def example_inputs_postnorm(batch_size: int = 8) -> torch.Tensor:
    return _ids(batch_size)


def example_inputs_llama(batch_size: int = 8) -> dict[str, torch.Tensor]:
    ids = _ids(batch_size)
    # The model's own loss (next-token cross entropy) drives training.
    return {"input_ids": ids, "labels": ids}


def gpt() -> nn.Module:
    gpt_file = _gpt_module()
    torch.manual_seed(0)
    return gpt_file.GPT(gpt_file.GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=2))


def example_inputs_gpt(batch_size: int = 8) -> torch.Tensor:
    return _ids(batch_size)


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """A Hugging Face *ForCausalLM's TP plan from the model root, as the profiler reads it
    (the model's own ``_tp_plan``: the config's ``base_model_tp_plan`` under the base
    model's prefix, the head's entries and the vocab-parallel embedding)."""
    from autopipe.profiler.tensor_parallel import model_tp_plan

    return model_tp_plan(model)


def tp_plan_of(name: str) -> dict[str, str]:
    """The TP plan of factory ``name`` (module paths from the model root)."""
    if name == "gpt":
        return dict(_gpt_module().tp_plan())
    return hf_tp_plan(globals()[name]())
