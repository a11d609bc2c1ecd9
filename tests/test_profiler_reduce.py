"""Counting a stack of repeated blocks as its first few (autopipe.profiler.reduce): the
head and period found from the blocks' structure, which counted block stands for which."""

from __future__ import annotations

import torch
from autopipe.profiler.reduce import BlockReduction, find_block_reduction, shortened
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int = 8, layer_idx: int = 0, bias: bool = False) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # differs per copy: not part of the structure
        self.lin = nn.Linear(width, width)
        if bias:
            self.position_bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_decoder_stack_has_period_one_and_no_head() -> None:
    model = Stack([Block(layer_idx=i) for i in range(8)])
    assert find_block_reduction(model) == BlockReduction("blocks", 8, head=0, period=1)


def test_a_first_block_of_its_own_is_the_head() -> None:
    """T5: the first block holds the relative position bias."""
    model = Stack([Block(bias=True)] + [Block() for _ in range(7)])
    reduction = find_block_reduction(model)
    assert reduction == BlockReduction("blocks", 8, head=1, period=1) and reduction.kept == 4


def test_alternating_blocks_have_period_two() -> None:
    model = Stack([Block(bias=i % 2 == 1) for i in range(10)])
    reduction = find_block_reduction(model)
    assert reduction == BlockReduction("blocks", 10, head=0, period=2) and reduction.kept == 6


def test_too_few_blocks_or_no_pattern_gain_nothing() -> None:
    assert find_block_reduction(Stack([Block() for _ in range(3)])) is None
    assert (
        find_block_reduction(Stack([Block(bias=i < 6) for i in range(8)]))  # 6 then 2
        is None
    )
    assert find_block_reduction(nn.Linear(2, 2)) is None


def test_every_block_is_counted_as_its_place_in_the_kept_periods() -> None:
    """Head 1, period 2, 11 blocks: kept 0..6; 1, 2 the first period, 3, 4 the middle one,
    5, 6 the last."""
    reduction = BlockReduction("blocks", 11, head=1, period=2)
    assert [reduction.counted_block(i) for i in range(11)] == [0, 1, 2, 3, 4, 3, 4, 3, 4, 5, 6]
    assert reduction.counted_cut(6) == reduction.counted_block(6)


def test_shortened_holds_the_kept_blocks_and_restores_the_container() -> None:
    model = Stack([Block() for _ in range(8)])
    original = model.blocks
    reduction = find_block_reduction(model)
    assert reduction is not None
    with shortened(model, reduction):
        assert len(model.blocks) == 3 and model.blocks[2] is original[2]
        assert model(torch.randn(2, 8)).shape == (2, 2)
    assert model.blocks is original and len(model.blocks) == 8
