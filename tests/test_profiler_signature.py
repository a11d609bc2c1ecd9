"""Which unit calls are the same computation (autopipe.profiler.signature)."""

from __future__ import annotations

import torch
from autopipe.profiler.signature import (
    ModuleSignatures,
    call_signature,
    graph_signature,
    group_by_signature,
    tensor_signature,
    value_signature,
)
from torch import fx, nn


class Block(nn.Module):
    def __init__(self, width: int = 8, norm_first: bool = True) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(torch.relu(self.norm(x)))


def block_signature(block: nn.Module) -> str:
    gm = fx.symbolic_trace(block)
    return graph_signature(gm.graph.nodes, gm, ModuleSignatures())


def test_identical_blocks_share_a_signature_whatever_their_values() -> None:
    torch.manual_seed(0)
    first, second = Block(), Block()
    assert not torch.equal(first.lin.weight, second.lin.weight)
    modules = ModuleSignatures()
    assert modules(first) == modules(second)
    assert block_signature(first) == block_signature(second)


def test_another_width_dtype_mode_or_hyperparameter_is_another_computation() -> None:
    # All alive at once: the memo is keyed by module id, valid while the module lives.
    base = Block()
    others = [Block(width=16), Block().double(), Block().eval(), Block(norm_first=False)]
    modules = ModuleSignatures()
    assert [modules(m) != modules(base) for m in others] == [True] * 4
    assert len({modules(m) for m in others}) == 4
    assert block_signature(others[0]) != block_signature(base)


def test_call_signature_tells_argument_shapes_and_activation_flags_apart() -> None:
    static = block_signature(Block())
    x4, x4_again, x5 = torch.randn(4, 8), torch.randn(4, 8), torch.randn(5, 8)
    same = call_signature(static, [x4], [True])
    assert call_signature(static, [x4_again], [True]) == same
    assert call_signature(static, [x5], [True]) != same
    assert call_signature(static, [x4], [False]) != same
    assert call_signature(block_signature(Block(width=16)), [x4], [True]) != same


def test_tensor_and_value_signatures() -> None:
    x = torch.zeros(3, 4)
    assert tensor_signature(x) == ("T", (3, 4), (4, 1), "torch.float32", "cpu", False, False)
    assert tensor_signature(x.t())[2] == (1, 4)  # strides decide the kernel too
    assert tensor_signature(nn.Parameter(x))[-2:] == (True, True)
    assert value_signature([x, 2, "a"]) == ("list", (tensor_signature(x), "2", "'a'"))
    assert value_signature({"k": slice(1, 3)}) == ("dict", (("k", ("slice", "1", "3", None)),))
    assert value_signature(torch.float16) == "torch.float16"


def test_group_by_signature_points_each_at_its_first() -> None:
    assert group_by_signature(["a", "b", "a", "c", "b", "a"]) == [0, 1, 0, 3, 1, 0]
    assert group_by_signature([]) == []
