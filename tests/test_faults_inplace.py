"""Issue 11, item 2: a cut right before an in-place op (``nn.ReLU(inplace=True)``, ``x.add_()``)
runs in every runtime, with the gradients of the unsplit model.

Each runtime hands a stage its inputs as autograd leaves, and autograd refuses an in-place
write into a leaf that requires grad ("a leaf Variable that requires grad is being used in
an in-place operation"); the stage now works on its own copy of such an input. The
torch.distributed case is in test_distributed.py (the "inplace" jobs, 2 and 4 ranks).
"""

from __future__ import annotations

import copy

import torch
from autopipe.profiler.units import trace_units
from autopipe.runtime import GPipe
from autopipe.runtime.distributed.stages import StageModule, split_stages
from distributed_cases import InPlaceNet, skipnet_inputs, skipnet_loss_one
from test_runtime_pipeline import assert_model_grads, hand_plan
from torch import nn

from autopipe.parallelizing import parallelize


def _reference(model: nn.Module, x: torch.Tensor) -> nn.Module:
    reference = copy.deepcopy(model)
    skipnet_loss_one(reference(x), x).backward()
    return reference


def test_parallelize_cuts_before_inplace_relu_and_add_() -> None:
    torch.manual_seed(0)
    model, x = InPlaceNet(), skipnet_inputs(8)[0]
    reference = _reference(model, x)
    ug = trace_units(model, x)
    assert ug.unit_names == ["f1", "act", "f2", "f3"]
    # Stage 1 starts with ReLU(inplace=True), stage 3 with h.add_(1.0).
    plan = hand_plan(ug.unit_names, [1, 1, 1, 1], 4, [False, True, False, False])
    pipe = parallelize(model, x, ["cpu"] * 4, plan=plan)
    out = pipe(x)
    with torch.no_grad():
        torch.testing.assert_close(out, copy.deepcopy(model)(x), rtol=1e-6, atol=1e-6)
    skipnet_loss_one(out, x).backward()
    assert_model_grads(model, reference)


def test_distributed_stages_take_leaves_they_write_into() -> None:
    """Stages as torch.distributed.pipelining drives them: each receives fresh leaves that
    require grad, and backward goes stage by stage from the received gradients."""
    torch.manual_seed(0)
    model, x = InPlaceNet(), skipnet_inputs(8)[0]
    reference = _reference(model, x)
    stages = [StageModule(s) for s in split_stages(trace_units(model, x), [0, 1, 2, 3])]
    runs: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = []
    values: tuple[torch.Tensor, ...] = (x,)
    for stage in stages:
        if runs:
            values = tuple(v.detach().requires_grad_(True) for v in values)
        out = stage(*values)
        outs = out if isinstance(out, tuple) else (out,)
        runs.append((values, outs))
        values = outs
    skipnet_loss_one(values[0], x).backward()
    for (inputs, _), (_, outs) in zip(runs[1:][::-1], runs[:-1][::-1], strict=True):
        torch.autograd.backward(list(outs), [v.grad for v in inputs])
    assert_model_grads(model, reference)


def test_gpipe_partition_starting_with_inplace_relu() -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    reference = copy.deepcopy(seq)
    x = torch.randn(6, 8)
    pipe = GPipe(seq, balance=[1, 2], devices=["cpu", "cpu"], chunks=3, checkpoint="never")
    pipe(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    for (name, p), q in zip(seq.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
