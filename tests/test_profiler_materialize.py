"""Measuring a model larger than the device one unit's weights at a time
(autopipe.profiler.materialize): meta tensors given real storage in place and sent back."""

from __future__ import annotations

import torch
from autopipe.profiler.materialize import (
    META,
    Materializer,
    on_meta,
    own_meta_state,
    retarget_devices,
    to_meta,
)
from autopipe.profiler.memory import storage_key
from torch import fx, nn

CPU = torch.device("cpu")
F32 = 4


class Scaled(nn.Module):
    """Parameters no ``reset_parameters`` initialises: the plain fill does."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(8))
        self.table = nn.Parameter(torch.empty(64, 64))
        self.offset = nn.Parameter(torch.empty(8))


def test_one_unit_at_a_time_in_place_and_back() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    assert on_meta(model)
    weight = model[0].weight
    exclude: set = set()
    mat = Materializer(model, CPU, exclude)
    mat.materialize(model[1].parameters())
    assert torch.equal(model[1].weight, torch.ones(8)) and torch.equal(
        model[1].bias, torch.zeros(8)
    )
    assert model[0].weight.is_meta and mat.live_bytes == 16 * F32
    mat.materialize(model[0].parameters())
    assert model[0].weight is weight and weight.device == CPU  # the same object, now real
    assert isinstance(weight, nn.Parameter) and weight.requires_grad
    assert torch.isfinite(weight).all() and weight.std() > 0  # Linear's own initialisation
    assert mat.live_bytes == mat.peak_bytes == (16 + 40) * F32
    assert storage_key(weight) in exclude and len(exclude) == 4
    weight.grad = torch.ones_like(weight)
    mat.release(model[0].parameters())
    assert weight.is_meta and weight.grad is None and len(exclude) == 2
    assert mat.peak_bytes == 56 * F32 and mat.live_bytes == 16 * F32
    mat.release()
    assert not mat.live and on_meta(model) and not exclude


def test_the_plain_fill_where_no_module_resets() -> None:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Scaled()
    Materializer(model, CPU, set()).materialize(model.parameters())
    assert torch.equal(model.scale, torch.ones(8))  # a 1-D scale: ones
    assert torch.equal(model.offset, torch.zeros(8))
    assert abs(model.table.std().item() - 0.02) < 0.002 and abs(model.table.mean().item()) < 0.002


def test_inputs_to_meta_and_meta_devices_retargeted() -> None:
    inputs = {"x": torch.ones(2, 3), "n": 4}
    meta = to_meta(inputs)
    assert meta["x"].is_meta and meta["x"].shape == (2, 3) and meta["n"] == 4

    class Positions(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.arange(x.shape[-1], device=META)

    gm = fx.symbolic_trace(Positions())
    assert retarget_devices([gm], CPU) == 1
    assert torch.equal(gm(torch.zeros(2, 3)), torch.arange(3.0).expand(2, 3))
    assert retarget_devices([gm], CPU) == 0


def test_own_meta_state_keeps_tied_weights_tied() -> None:
    with torch.device("meta"):
        emb, head = nn.Embedding(5, 4), nn.Linear(4, 5, bias=False)
    head.weight = emb.weight
    gm = fx.symbolic_trace(nn.Sequential(emb, head))
    before = gm.get_submodule("0").weight
    assert own_meta_state(gm) == 1
    after = gm.get_submodule("0").weight
    assert after is not before and after.is_meta and isinstance(after, nn.Parameter)
    assert gm.get_submodule("1").weight is after
