"""DeferredBatchNorm (autopipe.runtime.batchnorm): each micro-batch normalised with its own
statistics, the running statistics moved once per mini-batch with the whole batch's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from autopipe.profiler.units import trace_units
from autopipe.runtime.batchnorm import (
    DeferredBatchNorm,
    begin_minibatch,
    convert_deferred_batch_norm,
)
from autopipe.runtime.checkpoint import recomputing
from runtime_helpers import assert_close
from test_runtime_pipeline import hand_plan, small_resnet
from torch import nn

from autopipe import parallelize


def test_resnet_pipeline_deferred_batch_norm() -> None:
    """Running statistics move once per mini-batch; the stem's equal the unsplit model's."""
    model, x = small_resnet()
    unsplit = copy.deepcopy(model)
    ug = trace_units(model, x)
    plan = hand_plan(ug.unit_names, [2, 1, ug.num_units - 3], 4, [True, False, False])
    pipe = parallelize(model, x, ["cpu"] * 3, plan=plan, deferred_batch_norm=True)
    pipe(x).sum().backward()
    unsplit(x)
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(int(m.num_batches_tracked) == 1 for m in norms)
    assert_close(norms[0].running_mean, unsplit[0][1].running_mean, "stem running mean")
    assert_close(norms[0].running_var, unsplit[0][1].running_var, "stem running var")


def test_deferred_batch_norm_tracks_each_layers_whole_minibatch() -> None:
    """Every BatchNorm, in every stage, moves its running statistics once per step with the
    mean and (unbiased) variance of all the inputs it saw in that step, as the unsplit model
    does on a batch; without deferral they move once per micro-batch."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8)
    )
    x = torch.randn(12, 6)
    norms = [model[1], model[4]]
    before = [(bn.running_mean.clone(), bn.running_var.clone()) for bn in norms]
    ug = trace_units(model, x, granularity="module")
    plan = hand_plan(ug.unit_names, [2, 3], 3, [False, False])
    pipe = parallelize(model, x, ["cpu", "cpu"], plan=plan, deferred_batch_norm=True)
    deferred = [m for m in pipe.stages.modules() if isinstance(m, DeferredBatchNorm)]
    assert len(deferred) == 2  # one per stage, sharing the model's buffers
    seen: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for i, bn in enumerate(deferred):
        bn.register_forward_pre_hook(lambda _m, args, i=i: seen[i].append(args[0].detach()))
    pipe(x).sum().backward()
    for i, bn in enumerate(norms):
        assert len(seen[i]) == 3  # three micro-batches went through
        batch = torch.cat(seen[i])
        mean, var = before[i]
        assert int(bn.num_batches_tracked) == 1
        assert_close(bn.running_mean, 0.9 * mean + 0.1 * batch.mean(0), f"mean {i}")
        assert_close(bn.running_var, 0.9 * var + 0.1 * batch.var(0, unbiased=True), f"var {i}")


def test_three_microbatches_move_the_statistics_once_by_the_whole_batch() -> None:
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(3)
    deferred = DeferredBatchNorm.from_batch_norm(plain)
    x = torch.randn(6, 3, 4, 4) * 2 + 1
    deferred.begin(3)
    for i, piece in enumerate(x.chunk(3)):
        out = deferred(piece)
        # normalised by the micro-batch's own statistics (as GPipe does)
        assert_close(out, F.batch_norm(piece, None, None, training=True), "output")
        if i < 2:
            assert int(plain.num_batches_tracked) == 0  # nothing moves before the last
    assert int(plain.num_batches_tracked) == 1  # the shared buffers moved once
    assert_close(plain.running_mean, 0.1 * x.mean((0, 2, 3)), "running mean")
    unbiased = x.transpose(0, 1).reshape(3, -1).var(1, unbiased=True)
    assert_close(plain.running_var, 0.9 + 0.1 * unbiased, "running var")


def test_recomputation_is_not_counted() -> None:
    deferred = DeferredBatchNorm(2)
    deferred.begin(1)
    x = torch.randn(4, 2)
    with recomputing():
        deferred(x)
    assert int(deferred.num_batches_tracked) == 0
    assert torch.equal(deferred.running_mean, torch.zeros(2))
    deferred(x)
    assert int(deferred.num_batches_tracked) == 1


def test_cumulative_average_without_momentum() -> None:
    """momentum=None: the running mean is the plain average of the mini-batch means."""
    deferred = DeferredBatchNorm(1, momentum=None)
    means = []
    for value in (2.0, 6.0):
        x = torch.full((4, 1), value) + torch.tensor([[-1.0], [1.0], [-1.0], [1.0]])
        begin_minibatch([deferred], 2)
        deferred(x[:2])
        deferred(x[2:])
        means.append(value)
    assert int(deferred.num_batches_tracked) == 2
    assert deferred.running_mean.item() == pytest.approx(sum(means) / 2)
    assert deferred.running_var.item() == pytest.approx(4 / 3)  # unbiased var of +-1 over 4


def test_convert_replaces_tracking_norms_in_place_sharing_their_tensors() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1),
        nn.BatchNorm2d(4),
        nn.Sequential(nn.BatchNorm2d(4).eval(), nn.BatchNorm2d(4, track_running_stats=False)),
    )
    weight, mean = model[1].weight, model[1].running_mean
    assert convert_deferred_batch_norm(model) is model
    assert isinstance(model[1], DeferredBatchNorm) and isinstance(model[2][0], DeferredBatchNorm)
    assert type(model[2][1]) is nn.BatchNorm2d  # nothing to defer without running stats
    assert model[1].weight is weight and model[1].running_mean is mean
    assert model[1].training and not model[2][0].training
    # In eval mode it normalises with the running statistics, as a BatchNorm does.
    x = torch.randn(2, 4, 3, 3)
    reference = nn.BatchNorm2d(4).eval()
    assert_close(model[2][0](x), reference(x), "eval output")
    with pytest.raises(ValueError, match="expected at least 2D input"):
        model[1](torch.randn(4))
