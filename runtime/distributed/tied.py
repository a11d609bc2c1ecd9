"""Tied parameters across ranks: one logical parameter, a copy on every rank that uses it.

GPT-2's token embedding is also its LM head, T5's shared embedding serves the encoder, the
decoder and the head: in a pipeline the chunks using it may sit on different ranks. Each
such rank keeps its own copy; the copies start equal (broadcast from the rank of the first
chunk that holds the parameter) and stay equal because after every backward their gradients
are summed over the holding ranks (one flat all-reduce per group of ranks, as Megatron-LM
does for its word embeddings) and every copy then takes the same optimizer step. The
gradient is then that of the unsplit model, where both uses accumulate into one ``.grad``.

Chunks on the same rank (V > 1 virtual stages, e.g. the V-shape's chunks 0 and 2K-1 on
rank 0) are cut from one model, so they already hold the *same* parameter object: its
``.grad`` sums both uses, and it takes part in the all-reduce once. A parameter whose
chunks all sit on one rank needs no group at all.

With D data-parallel replicas there is one group per replica (the holding ranks of that
replica's pipeline); the replica average of every gradient follows as usual.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from autopipe.runtime.distributed.layout import RankLayout
from autopipe.runtime.distributed.process import group_timeout
from autopipe.runtime.planned_stages import TiedParameter
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["TiedGradients"]


@dataclass
class _Group:
    group: dist.ProcessGroup | None
    source_rank: int
    """Global rank holding the first chunk that uses any of the group's parameters (the
    copies the others start from)."""
    parameters: list[nn.Parameter]


class TiedGradients:
    """This rank's tied parameters and the process groups that keep their copies equal.

    Creates a process group per set of holding pipeline ranks and replica on every rank (as
    ``new_group`` requires, even on ranks outside it). ``tied``: every tied parameter of the
    plan, from :func:`autopipe.runtime.planned_stages.partition` (its ``stages`` are chunk
    indices); ``chunk_rank[c]``: the pipeline rank running chunk ``c``; ``modules``: this
    rank's chunk modules by chunk index (``StageModule``).
    """

    def __init__(
        self,
        tied: Sequence[TiedParameter],
        layout: RankLayout,
        modules: Mapping[int, nn.Module],
        chunk_rank: Sequence[int],
    ) -> None:
        self.layout = layout
        self._groups: list[_Group] = []
        holders: dict[tuple[int, ...], list[TiedParameter]] = {}
        for t in tied:
            ranks = tuple(sorted({chunk_rank[c] for c in t.stages}))
            if len(ranks) > 1:  # on one rank the chunks already share one parameter
                holders.setdefault(ranks, []).append(t)
        for rank_set in sorted(holders):
            mine = holders[rank_set]
            for replica in range(layout.replicas):
                members = [r * layout.replicas + replica for r in rank_set]
                group = dist.new_group(members, timeout=group_timeout())
                if layout.stage not in rank_set or replica != layout.replica:
                    continue
                params: list[nn.Parameter] = []
                for t in mine:
                    chunk = next(c for c in t.stages if chunk_rank[c] == layout.stage)
                    body = getattr(modules[chunk], "body", modules[chunk])
                    p = body.get_parameter(t.names[chunk][0])
                    if all(p is not q for q in params):
                        params.append(p)
                source = chunk_rank[min(c for t in mine for c in t.stages)]
                self._groups.append(_Group(group, source * layout.replicas + replica, params))

    def __len__(self) -> int:
        """How many tied parameters this rank holds."""
        return sum(len(g.parameters) for g in self._groups)

    def synchronize(self) -> None:
        """Make every copy equal to the source rank's (once, at start-up)."""
        with torch.no_grad():
            for g in self._groups:
                for p in g.parameters:
                    dist.broadcast(_local(p.data), src=g.source_rank, group=g.group)

    def reduce_gradients(self) -> None:
        """Sum each tied parameter's gradient over the ranks holding it (after backward).
        A tensor-parallel (or sharded) copy is a DTensor placed alike on every holding rank
        (the same TP coordinate of each stage holds the same rows): its local shards are
        summed, which sums the whole gradient shard by shard."""
        for g in self._groups:
            for p in g.parameters:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif (
                    isinstance(p, DTensor)
                    and isinstance(p.grad, DTensor)
                    and p.grad.placements != p.placements
                ):
                    # A vocab-parallel embedding's gradient comes back Replicate: its rows as
                    # the weight holds them (a local slice, no communication), as the head's.
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            grads = [_local(p.grad) for p in g.parameters if p.grad is not None]
            flat = torch.cat([x.reshape(-1) for x in grads])
            dist.all_reduce(flat, group=g.group)
            offset = 0
            for x in grads:
                n = x.numel()
                x.copy_(flat[offset : offset + n].view_as(x))
                offset += n


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local shard, a plain tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t
