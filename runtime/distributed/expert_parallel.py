"""Expert parallelism (EP, degree E) of a plan's mixture-of-experts layers, on torch's own
all-to-all.

Each MoE layer's routed experts are spread over the E ranks of an expert-parallel group (E
consecutive data-parallel ranks of one pipeline stage, carved out of ``mesh["dp"]`` as
torchtitan carves its EP group out of the data-parallel ranks). A rank holds experts
``[r E_l, (r + 1) E_l)`` of every layer (``E_l = experts / E``), as ``DTensor`` s sharded
``Shard(0)`` over the EP mesh, so ``state_dict`` and ``full_tensor()`` see the whole layer.

What is replaced is the *experts* module (Hugging Face 5's fused experts: a module whose class
name ends in ``Experts`` with ``num_experts`` and 3-D parameters ``[num_experts, ...]``,
called ``experts(hidden [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]`` by
``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``, ``DeepseekV3MoE``, ...): the router and
the shared experts stay in the block and are data-parallel as any other module. One call of
:class:`ExpertParallel`, on each rank's own tokens:

1. the ``N k`` (token, expert) pairs are sorted by expert, hence by the rank owning it;
2. the counts per rank, then the pairs' expert ids, then their token rows (``[S, H]``) are
   exchanged with ``all_to_all_single`` over the EP group (the rows with
   ``torch.distributed._functional_collectives.all_to_all_single_autograd``, whose backward
   is the reverse all-to-all);
3. the received rows run through the model's own experts forward (its own activation, gate
   layout and biases), on this rank's experts, each row with weight 1;
4. the outputs go back with the reverse all-to-all, are put back in pair order, weighted by
   the routing weights (so the router's gradient is local) and summed over the ``k`` experts
   of each token: ``sum_k w_k f_{e_k}(x)``, what the experts module computes.

Gradients: an expert's gradient on its owner already sums every EP rank's tokens (the
backward all-to-all brings them home), so expert parameters are left out of the
data-parallel gradient sum; they are divided by the global item count as every gradient is,
so the update equals one process's. A stage graph traced by torch.export holds the experts'
forward inlined as aten ops: :func:`call_expert_modules` turns each such region back into one
``call_module``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard

from autopipe.core.errors import UsageError

__all__ = [
    "ExpertParallel",
    "ExpertParallelError",
    "ExpertZeroOptimizer",
    "call_expert_modules",
    "expert_modules",
    "recognise_experts",
]


class ExpertParallelError(UsageError, ValueError):
    """Expert parallelism cannot run this model or plan (one line saying why and what to do)."""


def recognise_experts(path: str, module: nn.Module) -> int:
    """The routed expert count of a fused experts module, or :class:`ExpertParallelError`
    (one line) when ``module`` is not one this runtime can spread (see the module docstring)."""
    count = getattr(module, "num_experts", None)
    params = dict(module.named_parameters(recurse=False))
    if (
        not isinstance(count, int)
        or count < 1
        or not params
        or any(p.dim() < 2 or p.shape[0] != count for p in params.values())
        or any(True for _ in module.buffers(recurse=False))
        or any(True for c in module.children() for _ in c.parameters())
    ):
        raise ExpertParallelError(
            f"{path} ({type(module).__name__}) is not a fused experts module autopipe run can "
            "spread (num_experts and only [num_experts, ...] parameters, called with hidden "
            "states, top-k indices and top-k weights); re-plan with --expert-parallel 1"
        )
    return count


def expert_modules(model: nn.Module, degree: int) -> dict[str, int]:
    """Path -> routed expert count of every experts module of ``model`` (class name ending
    in ``Experts`` with ``num_experts``, as the profiler counts them,
    :mod:`autopipe.profiler.context_expert`); :class:`ExpertParallelError` when there is none,
    one is not recognised (:func:`recognise_experts`) or ``degree`` does not divide its
    experts."""
    found: dict[str, int] = {}
    for path, module in model.named_modules():
        if not type(module).__name__.endswith("Experts") or not hasattr(module, "num_experts"):
            continue
        count = recognise_experts(path, module)
        if count % degree:
            raise ExpertParallelError(
                f"{path} has {count} experts, which expert parallelism {degree} does not "
                "divide; re-plan with an --expert-parallel that divides them"
            )
        found[path] = count
    if not found:
        raise ExpertParallelError(
            f"the plan spreads experts over {degree} ranks but the model has no experts "
            "module (a class named ...Experts with num_experts); re-plan with "
            "--expert-parallel 1"
        )
    return found


class ExpertParallel(nn.Module):
    """One rank's share of a fused experts module, exchanging tokens over ``ep_mesh`` (a 1-D
    DeviceMesh of E ranks). Its parameters have the experts module's names and are
    ``DTensor`` s ``Shard(0)`` over ``ep_mesh`` (local ``[num_experts / E, ...]``).

    ``forward(hidden [N, H], top_k_index [N, k] int, top_k_weights [N, k]) -> [N, H]`` in
    ``hidden``'s dtype, as the experts module's own forward."""

    def __init__(
        self,
        experts: nn.Module,
        weights: Mapping[str, torch.Tensor],
        ep_mesh: Any,
        num_experts: int,
    ) -> None:
        """``experts``: the model's own experts module (its forward is what runs; it may be
        on the meta device); ``weights``: its parameters by name, whole (``[num_experts,
        ...]``, the stage's materialised ones), of which this rank keeps its share."""
        super().__init__()
        self.degree = int(ep_mesh.size())
        self.rank = int(ep_mesh.get_local_rank())
        self.local_experts = num_experts // self.degree
        self.group = ep_mesh.get_group()
        start = self.rank * self.local_experts
        # The model's own module runs this rank's experts (its activation, gate layout,
        # biases); it is held outside the module tree, its parameters meta stand-ins that
        # each call replaces by the local shards (functional_call).
        inner = copy.copy(experts)
        inner._parameters = {}
        for name, p in weights.items():
            local = p.detach()[start : start + self.local_experts].clone()
            shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            self.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))
            inner._parameters[name] = nn.Parameter(
                torch.empty_like(local, device="meta"), requires_grad=False
            )
        self._inner = [inner]  # a list: not a submodule, its stand-ins not parameters

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        # Pairs sorted by expert, so by owner rank (experts are owned in consecutive runs).
        order = torch.argsort(ids, stable=True)
        sorted_ids = ids[order]
        owner = torch.div(sorted_ids, self.local_experts, rounding_mode="floor")
        send = torch.bincount(owner, minlength=self.degree)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        local_ids = sorted_ids - owner * self.local_experts
        got_ids = local_ids.new_empty(sum(recv_sizes))
        dist.all_to_all_single(
            got_ids, local_ids.contiguous(), recv_sizes, send_sizes, group=self.group
        )
        rows = hidden[torch.div(order, k, rounding_mode="floor")]
        got = all_to_all_single_autograd(rows, recv_sizes, send_sizes, self.group)
        weights = {
            name: p.to_local() if isinstance(p, DTensor) else p
            for name, p in self.named_parameters(recurse=False)
        }
        ones = torch.ones(got.shape[0], 1, dtype=top_k_weights.dtype, device=got.device)
        done = torch.func.functional_call(self._inner[0], weights, (got, got_ids[:, None], ones))
        back = all_to_all_single_autograd(done, send_sizes, recv_sizes, self.group)
        pairs = back[torch.argsort(order)]
        weighted = pairs * top_k_weights.reshape(-1, 1)
        return weighted.view(tokens, k, -1).sum(dim=1).to(hidden.dtype)


class ExpertZeroOptimizer:
    """ZeRO-1 of an expert-parallel stage (DeepSeek-V3's PP x EP x ZeRO-1 DP): two of torch's
    ``ZeroRedundancyOptimizer`` s, as Megatron's distributed optimizer splits the dense and
    the expert parameters.

    - The dense parameters (the same on every data-parallel rank) over ``dense_group`` (the
      stage's D replicas): each rank keeps the state of ``1 / D`` of them and broadcasts its
      updated share.
    - The expert shards differ between the E ranks of an EP group, so they cannot share one
      replica's update; the ranks holding the same experts (``expert_group``, the D / E EP
      groups' same-position ranks) can: ZeRO-1 over it on the shards' local tensors
      (``ZeroRedundancyOptimizer`` takes no DTensor; the optimizer updates aliases of the
      local tensors in place, their gradients the DTensor gradients' local tensors). With
      E = D (``expert_group`` None) no other rank holds them: a plain optimizer.

    Either way a rank keeps the optimizer state of ``1 / D`` of the stage's expert
    parameters, as of its dense ones. The gradients are summed before ``step`` by the
    pipeline (dense over the replicas, experts over ``expert_group``)."""

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        dense: list[nn.Parameter],
        experts: list[nn.Parameter],
        dense_group: Any,
        expert_group: Any,
        **options: Any,
    ) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.experts = experts
        self.dense: Any = (
            ZeroRedundancyOptimizer(
                dense, optimizer_class=optimizer_class, process_group=dense_group, **options
            )
            if dense
            else None
        )
        # Parameters sharing the shards' storage: what the ZeRO-1 optimizer updates in place.
        self.local = [
            nn.Parameter((p.to_local() if isinstance(p, DTensor) else p).detach()) for p in experts
        ]
        self.expert: Any = None
        if experts and expert_group is not None:
            self.expert = ZeroRedundancyOptimizer(
                self.local, optimizer_class=optimizer_class, process_group=expert_group, **options
            )
        elif experts:
            self.expert = optimizer_class(self.local, **options)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.dense is not None:
            self.dense.zero_grad(set_to_none=set_to_none)
        for p, local in zip(self.experts, self.local, strict=True):
            p.grad = local.grad = None

    def step(self) -> None:
        if self.dense is not None:
            self.dense.step()
        if self.expert is None:
            return
        for p, local in zip(self.experts, self.local, strict=True):
            grad = p.grad
            local.grad = grad.to_local() if isinstance(grad, DTensor) else grad
        self.expert.step()


def _in_module(node: fx.Node, path: str) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return any(str(v[0]) == path for v in stack.values())


def _tensor(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def call_expert_modules(body: fx.GraphModule, paths: Mapping[str, int]) -> dict[str, str]:
    """Rewrite ``body`` (in place) so each experts module of ``paths`` it computes is one
    ``call_module(path, (hidden, top_k_index, top_k_weights))`` (torch.export inlines its
    forward into aten ops; an fx graph that calls it as a module is left as it is). The
    arguments are told apart by what they are: the integer tensor is the indices, the float
    tensor of the indices' shape the weights, the other the hidden states. Returns the new
    node's name -> the name of the node whose value it now computes (the runtime's unit
    map follows it); :class:`ExpertParallelError` when a region does not read those three."""
    graph = body.graph
    renamed: dict[str, str] = {}
    for path in paths:
        if any(n.op == "call_module" and n.target == path for n in graph.nodes):
            continue
        nodes = [
            n
            for n in graph.nodes
            if n.op in ("call_function", "call_method", "call_module") and _in_module(n, path)
        ]
        if not nodes:
            continue  # another stage's layer
        inside = set(nodes)
        reads: list[fx.Node] = []
        for n in nodes:
            for a in n.all_input_nodes:
                if a not in inside and a.op != "get_attr" and _tensor(a) is not None:
                    if a not in reads:
                        reads.append(a)
        outs = [
            n for n in nodes if _tensor(n) is not None and any(u not in inside for u in n.users)
        ]
        index = [a for a in reads if not _tensor(a).is_floating_point()]  # type: ignore[union-attr]
        floats = [a for a in reads if _tensor(a).is_floating_point()]  # type: ignore[union-attr]
        shape_of = {a: tuple(_tensor(a).shape) for a in reads}  # type: ignore[union-attr]
        weights = [a for a in floats if index and shape_of[a] == shape_of[index[0]]]
        hidden = [a for a in floats if a not in weights]
        if len(index) != 1 or len(weights) != 1 or len(hidden) != 1 or len(outs) != 1:
            raise ExpertParallelError(
                f"{path}'s traced forward reads {len(reads)} tensors and returns {len(outs)} "
                "(expected hidden states, top-k indices and top-k weights, and one output); "
                "autopipe run cannot spread it: re-plan with --expert-parallel 1"
            )
        out = outs[0]
        with graph.inserting_before(out):
            call = graph.call_module(path, (hidden[0], index[0], weights[0]))
        call.meta = dict(out.meta)
        out.replace_all_uses_with(call)
        renamed[call.name] = out.name
        # What only the region used goes; sizes it computed that others read stay.
        for n in reversed(nodes):
            if not n.users:
                graph.erase_node(n)
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    graph.lint()
    body.recompile()
    return renamed
