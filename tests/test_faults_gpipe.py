"""What torchgpipe users expect of autopipe.GPipe (issue 11): casting works and only moving
is refused, chunks=42.0 is 42, an empty Sequential is the identity, and torchgpipe's
``partitions.N.``-prefixed checkpoints load."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopipe import GPipe


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize(
    ("cast", "dtype"),
    [
        (lambda m: m.half(), torch.float16),
        (lambda m: m.double(), torch.float64),
        (lambda m: m.bfloat16(), torch.bfloat16),
        (lambda m: m.to(torch.double), torch.float64),
        (lambda m: m.to(dtype=torch.float16), torch.float16),
        (lambda m: m.type(torch.float64), torch.float64),
    ],
    ids=["half", "double", "bfloat16", "to-dtype", "to-dtype-keyword", "type-dtype"],
)
def test_casting_is_allowed(cast, dtype: torch.dtype) -> None:
    pipe = GPipe(_mlp(), balance=[3, 2], devices=["cpu", "cpu"], chunks=2)
    assert cast(pipe) is pipe
    assert {p.dtype for p in pipe.parameters()} == {dtype}
    if dtype == torch.float64:  # the cast weights are the ones the pipeline runs
        out = pipe(torch.randn(4, 4, dtype=dtype))
        assert out.dtype == dtype and out.shape == (4, 2)


@pytest.mark.parametrize(
    "move",
    [
        lambda m: m.to("cpu"),
        lambda m: m.to(torch.device("cpu"), torch.float64),
        lambda m: m.to(device="cpu"),
        lambda m: m.to(torch.zeros(1)),
        lambda m: m.cpu(),
        lambda m: m.cuda(),
        lambda m: m.type("torch.DoubleTensor"),
    ],
    ids=["to-device", "to-device-dtype", "to-device-keyword", "to-tensor", "cpu", "cuda", "type-name"],
)  # fmt: skip
def test_moving_is_refused(move) -> None:
    pipe = GPipe(_mlp(), balance=[3, 2], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="cannot be moved"):
        move(pipe)
    assert {p.dtype for p in pipe.parameters()} == {torch.float32}


def test_integral_float_chunks_are_taken() -> None:
    assert GPipe(_mlp(), balance=[5], devices=["cpu"], chunks=42.0).chunks == 42
    with pytest.raises(ValueError, match="positive integer"):
        GPipe(_mlp(), balance=[5], devices=["cpu"], chunks=2.5)


def test_empty_sequential_is_the_identity() -> None:
    pipe = GPipe(nn.Sequential(), balance=[])
    x = torch.randn(3, 4)
    assert pipe(x) is x
    assert len(pipe) == 0 and list(pipe.state_dict()) == []


def test_torchgpipe_checkpoints_load() -> None:
    source = _mlp()
    pipe = GPipe(_mlp(), balance=[3, 2], devices=["cpu", "cpu"])
    assert list(pipe.state_dict()) == list(source.state_dict())  # the Sequential's own keys
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    # torchgpipe's layout: partition j holds its layers under their original names.
    partition = {"0": 0, "2": 0, "4": 1}
    torchgpipe_keys = {
        f"partitions.{partition[k.split('.')[0]]}.{k}": v for k, v in source.state_dict().items()
    }
    assert pipe.load_state_dict(torchgpipe_keys) is not None
    for name, value in source.state_dict().items():
        assert torch.equal(pipe.state_dict()[name], value), name
    # Nested in a larger module, the prefix comes after the parent's.
    outer = nn.ModuleDict({"pipe": GPipe(_mlp(), balance=[3, 2], devices=["cpu", "cpu"])})
    outer.load_state_dict({f"pipe.{k}": v for k, v in torchgpipe_keys.items()})
    assert torch.equal(outer["pipe"][4].bias, source[4].bias)
    with pytest.raises(RuntimeError, match="Missing key"):  # strict loading still checks
        pipe.load_state_dict({k: v for k, v in torchgpipe_keys.items() if "4." not in k})
