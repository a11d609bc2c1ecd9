"""Tied parameters across ranks: one logical parameter, a copy on every stage that uses it.

GPT-2's token embedding is also its LM head, T5's shared embedding serves the encoder, the
decoder and the head: in a pipeline those stages sit on different ranks. Each such rank
keeps its own copy; the copies start equal (broadcast from the first stage that holds the
parameter) and stay equal because after every backward their gradients are summed over the
holding stages (one flat all-reduce per group of stages, as Megatron-LM does for its word
embeddings) and every copy then takes the same optimizer step. The gradient is then that of
the unsplit model, where both uses accumulate into one ``.grad``.

With D data-parallel replicas there is one group per replica (the holding stages of that
replica's pipeline); the replica average of every gradient follows as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from autopipe.runtime.distributed.layout import RankLayout
from autopipe.runtime.distributed.process import group_timeout
from autopipe.runtime.partition import TiedParameter
from torch import nn

__all__ = ["TiedGradients"]


@dataclass
class _Group:
    group: object
    source_rank: int
    """Global rank of the first holding stage (the copy the others start from)."""
    parameters: list[nn.Parameter]


class TiedGradients:
    """This rank's tied parameters and the process groups that keep their copies equal.

    Creates a process group per set of holding stages and replica on every rank (as
    ``new_group`` requires, even on ranks outside it). ``module``: this rank's stage module
    (a ``StageModule``); ``tied``: every tied parameter of the plan, from
    :func:`autopipe.runtime.partition.partition`.
    """

    def __init__(
        self, tied: Sequence[TiedParameter], layout: RankLayout, module: nn.Module
    ) -> None:
        self.layout = layout
        self._groups: list[_Group] = []
        body = getattr(module, "body", module)
        for stage_set in sorted({tuple(t.stages) for t in tied}):
            mine = [t for t in tied if tuple(t.stages) == stage_set]
            for replica in range(layout.replicas):
                ranks = [stage * layout.replicas + replica for stage in stage_set]
                group = dist.new_group(ranks, timeout=group_timeout())
                if layout.stage not in stage_set or replica != layout.replica:
                    continue
                params = [body.get_parameter(t.names[layout.stage][0]) for t in mine]
                self._groups.append(_Group(group, ranks[0], params))

    def __len__(self) -> int:
        """How many tied parameters this rank holds."""
        return sum(len(g.parameters) for g in self._groups)

    def synchronize(self) -> None:
        """Make every copy equal to the first holding stage's (once, at start-up)."""
        with torch.no_grad():
            for g in self._groups:
                for p in g.parameters:
                    dist.broadcast(p.data, src=g.source_rank, group=g.group)

    def reduce_gradients(self) -> None:
        """Sum each tied parameter's gradient over the stages holding it (after backward)."""
        for g in self._groups:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in g.parameters]
            flat = torch.cat([x.reshape(-1) for x in grads])
            dist.all_reduce(flat, group=g.group)
            offset = 0
            for p, x in zip(g.parameters, grads, strict=True):
                n = x.numel()
                p.grad = flat[offset : offset + n].view_as(p).clone()
                offset += n
