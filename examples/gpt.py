"""A GPT-style decoder: token + position embedding, N pre-norm transformer blocks,
final LayerNorm and an LM head over a large vocabulary.

The head (d_model x vocab) costs about two blocks' worth of compute and the embeddings
almost nothing, so splitting by equal layer counts (or by parameter counts: the token
embedding is as big as the head) leaves some stage the bottleneck: the case autopipe plans for.

    autopipe plan examples/gpt.py --gpus 8
    autopipe plan examples/gpt.py:gpt_6b --gpus 8 --device a100-80gb   # analytic
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 4096
    seq_len: int = 64
    d_model: int = 256
    n_layer: int = 13
    n_head: int = 4
    dropout: float = 0.0
    tie_weights: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, seq, d_model)
        b, t, c = x.shape
        head_dim = c // self.n_head
        # qkv's outputs are laid out head by head ([q k v] of head 0, then head 1, ...) and
        # the head count is read off the tensor (-1), so a column-wise split of qkv over T
        # ranks (tensor parallelism) gives each rank whole heads and it runs n_head / T.
        qkv = self.qkv(x).view(b, t, -1, 3 * head_dim).transpose(1, 2)
        q, k, v = qkv.split(head_dim, dim=3)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, -1)
        return self.drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # idx: (batch, seq) int64 token ids -> logits (batch, seq, vocab)
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def tp_plan() -> dict[str, str]:
    """Megatron-style tensor parallelism for :class:`GPT` (module path pattern -> style,
    Hugging Face's words): attention's qkv and the MLP's fc split by output columns, their
    projections by input rows (one all-reduce per sub-block), the head split by vocabulary
    columns and its logits gathered; embeddings and norms replicated."""
    return {
        "blocks.*.attn.qkv": "colwise",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
        "head": "colwise_rep",
    }


def build_model(**overrides) -> GPT:
    """The default example: 13 blocks, d_model 256, vocab 4096 (about 12 M parameters)."""
    torch.manual_seed(0)
    return GPT(GPTConfig(**overrides))


def example_inputs(batch_size: int = 16, cfg: GPTConfig | None = None) -> torch.Tensor:
    cfg = cfg or GPTConfig()
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), generator=g)


def loss_fn(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy; the profiler drives backward with it."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


# 48 blocks x d_model 3072: 5.75 B parameters (12 d^2 per block plus embeddings).
GPT_6B = GPTConfig(vocab_size=50304, seq_len=2048, d_model=3072, n_layer=48, n_head=24)


def gpt_6b() -> GPT:
    """A 6 B-parameter decoder (48 blocks, d_model 3072): build it on the meta device only."""
    return GPT(GPT_6B)


def example_inputs_gpt_6b(batch_size: int = 8) -> torch.Tensor:
    return example_inputs(batch_size, GPT_6B)


# 32 blocks x d_model 4096: 6.86 B parameters, 25.6 GiB in fp32 (more than this CPU machine
# holds): `autopipe plan examples/gpt.py:gpt_7b --gpus 8` builds it on meta and measures it
# one unit at a time (--meta-init, automatic when it does not fit).
GPT_7B = GPTConfig(vocab_size=50304, seq_len=2048, d_model=4096, n_layer=32, n_head=32)


def gpt_7b() -> GPT:
    """A 6.9 B-parameter decoder (32 blocks, d_model 4096), 25.6 GiB of fp32 weights."""
    return GPT(GPT_7B)


def example_inputs_gpt_7b(batch_size: int = 1, seq_len: int = 128) -> torch.Tensor:
    """(batch, seq_len) token ids; 128 tokens by default, so a CPU measures a block in seconds
    (positions up to 2048 are valid)."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, GPT_7B.vocab_size, (batch_size, seq_len), generator=g)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    m = build_model()
    print(f"{num_parameters(m) / 1e6:.1f} M parameters, {math.prod(example_inputs().shape)} tokens")
