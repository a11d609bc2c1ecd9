"""DeferredBatchNorm: per-micro-batch normalisation, running statistics once per mini-batch.

In a pipeline every micro-batch is normalised with its own statistics (as in GPipe), but a
plain BatchNorm would also move its running averages once per micro-batch, M times per
step. ``DeferredBatchNorm`` accumulates the per-channel sum and sum of squares (in float64)
over the micro-batches of one mini-batch and, after the last one, updates the running
mean/variance and ``num_batches_tracked`` once, with the statistics of the whole mini-batch:
the same update the unsplit model makes. Recomputations (``checkpoint.is_recomputing``) are
not counted. Cost: two reductions per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from autopipe.runtime.checkpoint import is_recomputing
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["DeferredBatchNorm", "begin_minibatch", "convert_deferred_batch_norm"]


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm (any of 1d/2d/3d) whose running statistics update once per mini-batch."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self._expected = 1
        self._reset_sums()

    def _reset_sums(self) -> None:
        self._seen = 0
        self._count = 0
        self._sum: torch.Tensor | None = None
        self._sum_sq: torch.Tensor | None = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"expected at least 2D input (batch, channels, ...), got {input.dim()}D"
            )

    def begin(self, num_microbatches: int) -> None:
        """Start a mini-batch of ``num_microbatches`` micro-batches (drops partial sums)."""
        self._expected = num_microbatches
        self._reset_sums()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training:
            return super().forward(input)
        output = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if not is_recomputing():
            self._accumulate(input.detach())
        return output

    @torch.no_grad()
    def _accumulate(self, x: torch.Tensor) -> None:
        dims = [0, *range(2, x.dim())]
        x64 = x.to(torch.float64)
        s, s2 = x64.sum(dims), (x64 * x64).sum(dims)
        self._sum = s if self._sum is None else self._sum + s
        self._sum_sq = s2 if self._sum_sq is None else self._sum_sq + s2
        self._count += x.numel() // x.shape[1]
        self._seen += 1
        if self._seen >= self._expected:
            self._commit()

    @torch.no_grad()
    def _commit(self) -> None:
        assert self._sum is not None and self._sum_sq is not None
        # track_running_stats is checked at construction: the buffers exist here
        assert self.num_batches_tracked is not None
        assert self.running_mean is not None and self.running_var is not None
        count = self._count
        mean = self._sum / count
        var = (self._sum_sq / count - mean * mean).clamp_min(0.0)
        unbiased = var * count / max(count - 1, 1)
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            factor = 1.0 / float(self.num_batches_tracked.item())
        else:
            factor = self.momentum
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        self._reset_sums()

    @classmethod
    def from_batch_norm(cls, bn: _BatchNorm) -> DeferredBatchNorm:
        """A DeferredBatchNorm sharing ``bn``'s parameters and buffers."""
        new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine)
        if bn.affine:
            new.weight, new.bias = bn.weight, bn.bias
        if bn.track_running_stats:
            new.running_mean, new.running_var = bn.running_mean, bn.running_var
            new.num_batches_tracked = bn.num_batches_tracked
        source = bn.weight if bn.affine else bn.running_mean
        assert source is not None
        new.to(device=source.device)
        new.train(bn.training)
        return new


def convert_deferred_batch_norm(module: nn.Module) -> nn.Module:
    """Replace every tracking BatchNorm inside ``module`` (in place) by a DeferredBatchNorm."""
    if (
        isinstance(module, _BatchNorm)
        and module.track_running_stats
        and not isinstance(module, DeferredBatchNorm)
    ):
        return DeferredBatchNorm.from_batch_norm(module)
    for name, child in module.named_children():
        new = convert_deferred_batch_norm(child)
        if new is not child:
            setattr(module, name, new)
    return module


def begin_minibatch(modules: list[nn.Module], num_microbatches: int) -> None:
    """Tell every DeferredBatchNorm in ``modules`` how many micro-batches this step has."""
    for top in modules:
        for m in top.modules():
            if isinstance(m, DeferredBatchNorm):
                m.begin(num_microbatches)
