"""Small models shaped like real ones, for the profiler tests (not collected by pytest)."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    """Import examples/<name>.py under a private module name."""
    key = f"_autopipe_example_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


class ShapeBranch(nn.Module):
    """Python control flow on a tensor's rank: fx cannot trace it, export specialises it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if x.dim() == 2:
            x = torch.relu(x)
        return self.b(x)


class DataBranch(nn.Module):
    """Data-dependent control flow between children: no tracer can handle it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if x.sum() > 0:
            x = x * 2
        else:
            x = x - 1
        return self.b(x)


class Gate(nn.Module):
    """A child with data-dependent control flow inside (untraceable on its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y if y.mean() > 0 else -y


class GatedChain(nn.Module):
    """A plain chain of children, one untraceable: profiled from forward hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.gate = Gate()
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(self.inp(x)))


class ChildPicker(nn.Module):
    """A parent that runs children by the batch size (``rows > 4`` or ``rows < 4`` runs all
    four, else only ``a`` and ``b``; ``rows > 1`` runs all four at 2 rows too); the
    data-dependent check makes fx and export fail, so the hooks tracer takes it."""

    def __init__(self, takes: str) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))
        self.takes = takes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.abs().sum() < 0):  # never true; fx and export cannot decide it
            x = -x
        rows = {"gt4": x.shape[0] > 4, "lt4": x.shape[0] < 4, "gt1": x.shape[0] > 1}[self.takes]
        for i, child in enumerate((self.a, self.b, self.c, self.d)):
            if rows or i < 2:
                x = child(x)
        return x


@dataclass
class DecoderConfig:
    vocab: int = 97
    seq: int = 16
    d: int = 32
    layers: int = 3
    heads: int = 4
    use_final_norm: bool = True


class DecoderBlock(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d)
        self.attn = nn.MultiheadAttention(cfg.d, cfg.heads, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.d)
        self.ff = nn.Sequential(nn.Linear(cfg.d, 4 * cfg.d), nn.GELU(), nn.Linear(4 * cfg.d, cfg.d))

    def forward(
        self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, key_padding_mask=key_padding_mask, need_weights=False)[0]
        return x + self.ff(self.ln2(x))


@dataclass
class DecoderOutput:
    logits: torch.Tensor
    hidden: torch.Tensor


class TiedDecoder(nn.Module):
    """Decoder with tied embedding/LM-head weights, an attention mask keyword argument,
    a Python ``if`` on a config flag and a dict output (or a dataclass output)."""

    def __init__(self, cfg: DecoderConfig | None = None, output: str = "dict") -> None:
        super().__init__()
        self.cfg = cfg = cfg or DecoderConfig()
        self.output = output
        self.wte = nn.Embedding(cfg.vocab, cfg.d)
        self.wpe = nn.Embedding(cfg.seq, cfg.d)
        self.h = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d)
        self.lm_head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor] | DecoderOutput:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        pad = None if attention_mask is None else attention_mask == 0
        for block in self.h:
            x = block(x, key_padding_mask=pad)
        if self.cfg.use_final_norm:
            x = self.ln_f(x)
        logits = self.lm_head(x)
        if self.output == "dataclass":
            return DecoderOutput(logits=logits, hidden=x)
        if self.output == "tuple":
            return logits, x
        return {"logits": logits, "hidden": x}


def decoder_inputs(batch: int = 4, cfg: DecoderConfig | None = None) -> dict[str, torch.Tensor]:
    cfg = cfg or DecoderConfig()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g)
    mask = torch.ones(batch, cfg.seq, dtype=torch.long)
    mask[:, -3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


class ResBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(ch)
        self.c2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


class SkipCNN(nn.Module):
    """CNN with BatchNorm, residual blocks and a long skip from the stem to the head."""

    def __init__(self, ch: int = 8, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU())
        self.body = nn.Sequential(*(ResBlock(ch) for _ in range(blocks)))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(ch, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stem(x)
        y = self.body(s) + s  # long skip across every body block
        return self.fc(self.pool(y).flatten(1))


class LSTMTagger(nn.Module):
    """An LSTM whose tuple output is unpacked; only the last step's output is used later."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 5)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, (h, c) = self.lstm(self.emb(x))
        return self.head(out[:, -1] * self.scale)


class GatedStack(nn.Module):
    """Untraceable children (a data-dependent gate) chained with a Sequential of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.layers = nn.Sequential(Gate(), Gate(), Gate())
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layers(self.inp(x)))
