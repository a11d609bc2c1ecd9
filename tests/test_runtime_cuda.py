"""CUDA paths of the executor (skipped without a GPU): events, per-GPU streams of randomness."""

from __future__ import annotations

import copy

import pytest
import torch
from autopipe.runtime import GPipe
from runtime_helpers import assert_close, assert_same_grads, reference_forward
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _devices(k: int) -> list[str]:
    count = torch.cuda.device_count()
    return [f"cuda:{j % count}" for j in range(k)]


@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_gpipe_on_cuda_matches_unpipelined(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )
    x = torch.randn(12, 16, device="cuda:0")
    reference = copy.deepcopy(model).to("cuda:0")
    pipe = GPipe(model, balance=[2, 2, 1], devices=_devices(3), chunks=4, checkpoint=mode)
    out = pipe(x)
    out.square().sum().backward()
    expected = reference_forward(reference, (x,), 4, seed=0)
    expected.square().sum().backward()
    assert_close(out.to("cuda:0"), expected, "output")
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        assert_close(p.grad.to("cuda:0"), q.grad, name)
    timeline = pipe.last_timeline
    records = timeline.tasks
    assert len([r for r in records if r.phase == "forward"]) == 12
    assert all(
        timeline.device_name(r.device).startswith("cuda") and r.end_s >= r.start_s for r in records
    )


def test_dropout_on_one_gpu_matches_microbatched_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 32), nn.Dropout(0.5), nn.Linear(32, 2)
    )
    model = model.to("cuda:0")
    x = torch.randn(10, 8, device="cuda:0")
    reference = copy.deepcopy(model)
    pipe = GPipe(model, balance=[2, 3], devices=["cuda:0", "cuda:0"], chunks=3, checkpoint="always")
    torch.manual_seed(7)
    out = pipe(x)
    out.sum().backward()
    expected = reference_forward(reference, (x,), 3, seed=7)
    expected.sum().backward()
    assert_close(out, expected, "output")
    assert_same_grads(pipe, reference)


def test_unindexed_cuda_and_a_cpu_last_stage() -> None:
    """ "cuda" names the same GPU as "cuda:0" (one worker); a GPU -> CPU hand-off is complete
    before the CPU stage reads it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 3))
    reference = copy.deepcopy(model)
    x = torch.randn(64, 8)
    torch.cuda.set_device(0)
    pipe = GPipe(model, balance=[1, 2, 1], devices=["cuda", "cuda:0", "cpu"], chunks=4)
    assert pipe.devices[:2] == [torch.device("cuda", 0)] * 2
    out = pipe(x.to("cuda:0"))
    out.sum().backward()
    expected = reference_forward(reference, (x,), 4, seed=0)
    expected.sum().backward()
    assert out.device.type == "cpu"
    assert_close(out, expected, "output")
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        assert_close(p.grad.cpu(), q.grad, name)
