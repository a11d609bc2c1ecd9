"""What a zero-bubble chunk needs to run split, found on fake tensors without launching
anything (autopipe.runtime.distributed.zero_bubble)."""

from __future__ import annotations

import torch
from autopipe.runtime.distributed.zero_bubble import weight_pass_misses, weight_pass_reuses
from torch import nn


class SideOutput(nn.Module):
    """A position table handed on as its own output: its path never meets the input's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.pos = nn.Parameter(torch.zeros(3, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), self.pos * 2.0


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.lin(x)))


def test_a_parameter_off_the_inputs_path_is_missed_unless_the_loss_joins_it() -> None:
    x = torch.randn(2, 4, requires_grad=True)
    assert weight_pass_misses(SideOutput(), [x]) == ["pos"]
    # The last chunk's loss joins every output: nothing is missed.
    assert weight_pass_misses(SideOutput(), [x], last=True) == []


def test_inputs_without_gradient_miss_every_parameter_of_the_last_chunk() -> None:
    x = torch.randn(2, 4)
    assert weight_pass_misses(SideOutput(), [x], last=True) == ["lin.bias", "lin.weight", "pos"]
    assert weight_pass_misses(SideOutput(), [x]) == ["lin.bias", "lin.weight", "pos"]


def test_a_plain_chain_misses_nothing_and_frozen_parameters_do_not_count() -> None:
    x = torch.randn(2, 4, requires_grad=True)
    assert weight_pass_misses(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), [x]) == []
    frozen = SideOutput()
    frozen.pos.requires_grad_(False)
    assert weight_pass_misses(frozen, [x]) == []


def test_reuses_of_a_layer_called_twice() -> None:
    x = torch.randn(2, 4, requires_grad=True)
    assert weight_pass_reuses(Shared(), [x]) == {"lin.bias": 2, "lin.weight": 2}
    assert weight_pass_reuses(nn.Linear(4, 4), [x]) == {}
    assert weight_pass_reuses(nn.ReLU(), [x]) == {}  # no parameters: no forward needed


def test_fake_forward_leaves_the_module_untouched() -> None:
    torch.manual_seed(0)
    model = Shared()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weight_pass_misses(model, [torch.randn(2, 4, requires_grad=True)])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
