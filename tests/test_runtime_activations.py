"""ActivationMeter: bytes autograd saves for backward, counted once, freed by backward."""

from __future__ import annotations

import torch
from autopipe.runtime.activations import ActivationMeter
from torch import nn


def test_saved_activations_are_counted_once_and_freed_by_backward() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    meter = ActivationMeter(layer.parameters())
    x = torch.randn(4, 8, requires_grad=True)
    with meter.saving():
        # Linear saves x (its weight is excluded: a parameter, and weight.t() covers the same
        # bytes); tanh saves its output; the product saves both factors, which are x and the
        # tanh output again (counted once): 2 tensors of 4 x 8 floats.
        y = torch.tanh(layer(x))
        z = (y * x).sum()
    assert meter.current_bytes == meter.peak_bytes == 2 * 4 * 8 * 4
    z.backward()
    assert meter.current_bytes == 0 and meter.peak_bytes == 2 * 4 * 8 * 4
    meter.reset_peak()
    assert meter.peak_bytes == 0


def test_a_retained_graph_keeps_its_bytes_until_it_goes() -> None:
    meter = ActivationMeter()
    x = torch.randn(16, requires_grad=True)
    with meter.saving():
        y = x.exp()  # saves its output: 64 bytes
    y.sum().backward(retain_graph=True)
    assert meter.current_bytes == 64
    del y
    assert meter.current_bytes == 0
