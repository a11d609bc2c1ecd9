"""Shared helpers for the runtime tests: example models and the unpipelined reference."""

from __future__ import annotations

from typing import Any

import torch
from autopipe.runtime.rng import draw_base_seed, microbatch_seed
from profiler_models import load_example  # noqa: F401  (re-exported for the runtime tests)
from torch import nn

RTOL, ATOL = 1e-5, 1e-6


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
