"""Shared helpers for the runtime tests: example models and the unpipelined reference."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from autopipe.runtime.rng import draw_base_seed, microbatch_seed
from torch import nn

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RTOL, ATOL = 1e-5, 1e-6


def load_example(name: str) -> ModuleType:
    """Import examples/<name>.py under a private module name."""
    key = f"_autopipe_example_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def reference_forward(
    model: nn.Module, inputs: tuple[Any, ...], chunks: int, seed: int
) -> torch.Tensor:
    """The unpipelined model run micro-batch by micro-batch (gradient accumulation), each
    micro-batch on the random stream the pipeline gives it (see autopipe.runtime.rng)."""
    torch.manual_seed(seed)
    base = draw_base_seed()
    batch = inputs[0].shape[0]
    num = min(chunks, batch)
    pieces = list(zip(*(torch.tensor_split(x, num) for x in inputs), strict=True))
    outs = []
    for i, piece in enumerate(pieces):
        torch.manual_seed(microbatch_seed(base, i))
        outs.append(model(*piece))
    return torch.cat(outs)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def assert_same_grads(pipelined: nn.Module, reference: nn.Module) -> None:
    """Every parameter gradient equal, matched by name (tied parameters appear once)."""
    got = dict(pipelined.named_parameters())
    want = dict(reference.named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert p.grad is not None, name
        assert got[name].grad is not None, f"{name}: no gradient in the pipeline"
        assert_close(got[name].grad, p.grad, f"grad of {name}")
