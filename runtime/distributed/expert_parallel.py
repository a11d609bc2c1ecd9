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
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from autopipe.runtime.distributed.mesh import LocalZeroOptimizer, make_zero_optimizer
from torch import fx, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopipe.core.errors import UsageError

__all__ = [
    "ExpertParallel",
    "ExpertParallelError",
    "ExpertZeroOptimizer",
    "TensorParallelExperts",
    "call_expert_modules",
    "expert_modules",
    "expert_tp_placements",
    "find_expert_modules",
    "full_layout",
    "recognise_experts",
    "split_experts",
    "tp_expert_modules",
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


def find_expert_modules(model: nn.Module) -> dict[str, int]:
    """Path -> routed expert count of every experts module of ``model`` (class name ending
    in ``Experts`` with ``num_experts``, as the profiler counts them,
    :mod:`autopipe.profiler.context_expert`), each recognised (:func:`recognise_experts`);
    empty when there is none."""
    found: dict[str, int] = {}
    for path, module in model.named_modules():
        if type(module).__name__.endswith("Experts") and hasattr(module, "num_experts"):
            found[path] = recognise_experts(path, module)
    return found


def expert_modules(model: nn.Module, degree: int) -> dict[str, int]:
    """Path -> routed expert count of every experts module of ``model`` (class name ending
    in ``Experts`` with ``num_experts``, as the profiler counts them,
    :mod:`autopipe.profiler.context_expert`); :class:`ExpertParallelError` when there is none,
    one is not recognised (:func:`recognise_experts`) or ``degree`` does not divide its
    experts."""
    found = find_expert_modules(model)
    for path, count in found.items():
        if count % degree:
            raise ExpertParallelError(
                f"{path} has {count} experts, which expert parallelism {degree} does not "
                "divide; re-plan with an --expert-parallel that divides them"
            )
    if not found:
        raise ExpertParallelError(
            f"the plan spreads experts over {degree} ranks but the model has no experts "
            "module (a class named ...Experts with num_experts); re-plan with "
            "--expert-parallel 1"
        )
    return found


class ExpertParallel(nn.Module):
    """One rank's share of a fused experts module, exchanging tokens over ``ep_mesh`` (a 1-D
    DeviceMesh of E ranks, or a 2-D ``(E, T)`` one whose second dimension is TP, each rank
    then holding a TP slice of its experts, :func:`expert_tp_placements`). Its parameters
    have the experts module's names and are ``DTensor`` s ``Shard(0)`` over the EP
    dimension (local ``[num_experts / E, ...]``), and with TP placed over the second as
    ``tp_placements`` say.

    ``forward(hidden [N, H], top_k_index [N, k] int, top_k_weights [N, k]) -> [N, H]`` in
    ``hidden``'s dtype, as the experts module's own forward. With TP (EP x TP), the TP
    group's tokens are gathered first (``token_layout`` as :class:`TensorParallelExperts`'s
    ``tokens``); every TP rank of an EP rank then sends the same tokens to the same owners,
    whose TP ranks each compute their slice, and the partial outputs, weighted and summed
    over ``k``, are reduce-scattered (all-reduced) over TP at the end."""

    _inner: list[nn.Module]
    """The model's own experts module, held outside the module tree (:func:`_hold_shards`)."""

    def __init__(
        self,
        experts: nn.Module,
        weights: Mapping[str, torch.Tensor],
        ep_mesh: Any,
        num_experts: int,
        tp_placements: Mapping[str, Any] | None = None,
        token_layout: str = "sharded",
    ) -> None:
        """``experts``: the model's own experts module (its forward is what runs; it may be
        on the meta device); ``weights``: its parameters by name, whole (``[num_experts,
        ...]``, the stage's materialised ones), of which this rank keeps its share."""
        super().__init__()
        two = ep_mesh.ndim == 2
        self.degree = int(ep_mesh.size(0))
        self.rank = int(ep_mesh.get_local_rank(0))
        self.local_experts = num_experts // self.degree
        self.group = ep_mesh.get_group(0)
        self.tp_mesh: Any = ep_mesh[ep_mesh.mesh_dim_names[1]] if two else None
        self.token_layout = token_layout
        start = self.rank * self.local_experts
        tp, tp_rank = (
            (int(self.tp_mesh.size()), int(self.tp_mesh.get_local_rank()))
            if self.tp_mesh is not None
            else (1, 0)
        )
        shards: dict[str, tuple[torch.Tensor, list[Any]]] = {}
        for name, p in weights.items():
            local = p.detach()[start : start + self.local_experts].clone()
            placements: list[Any] = [Shard(0)]
            if self.tp_mesh is not None:
                assert tp_placements is not None
                local = _local_slice(local, tp_placements[name], tp, tp_rank)
                placements.append(tp_placements[name])
            shards[name] = (local, placements)
        _hold_shards(self, experts, weights, shards, ep_mesh, tp)

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        dtype = hidden.dtype
        if self.tp_mesh is not None:  # EP x TP: the TP group's tokens, on every TP rank
            routing = top_k_weights.to(torch.promote_types(dtype, top_k_weights.dtype))
            hidden = _tp_gather(hidden, self.tp_mesh, self.token_layout)
            top_k_index = _tp_gather(top_k_index, self.tp_mesh, self.token_layout)
            top_k_weights = _tp_gather(routing, self.tp_mesh, self.token_layout)
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
        out = weighted.view(tokens, k, -1).sum(dim=1).to(dtype)
        if self.tp_mesh is not None:  # each TP rank's slice's part of every token's output
            out = _tp_reduce(out, self.tp_mesh, self.token_layout)
        return out


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
      (:class:`~.mesh.LocalZeroOptimizer`: ``ZeroRedundancyOptimizer`` takes no DTensor).
      With E = D (``expert_group`` None) no other rank holds them: a plain optimizer.

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
        # Dense: ZeroRedundancyOptimizer, over the DTensors' local tensors where TP split
        # them (LocalZeroOptimizer); the expert shards always over their local tensors.
        self.dense: Any = (
            make_zero_optimizer(optimizer_class, dense, dense_group, **options) if dense else None
        )
        self.expert: Any = None
        if experts and expert_group is not None:
            self.expert = LocalZeroOptimizer(optimizer_class, experts, expert_group, **options)
        elif experts:
            self.expert = optimizer_class(experts, **options)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in (self.dense, self.expert):
            if part is not None:
                part.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for part in (self.dense, self.expert):
            if part is not None:
                part.step()


def _hold_shards(
    owner: ExpertParallel | TensorParallelExperts,
    experts: nn.Module,
    weights: Mapping[str, torch.Tensor],
    shards: Mapping[str, tuple[torch.Tensor, list[Any]]],
    mesh: Any,
    tp: int,
) -> None:
    """Make ``owner`` hold each of ``experts``' parameters as this rank's shard (``shards``:
    name -> (local tensor, its placements over ``mesh``)), a ``DTensor`` parameter under the
    experts module's own name, and keep the model's own module (its activation, gate layout,
    biases) to run them: outside the module tree, its parameters meta stand-ins of the
    local shapes that each call replaces by the local shards (``functional_call``), its
    ``intermediate_dim`` divided by ``tp`` where TP slices each expert's FFN."""
    inner = copy.copy(experts)
    inner._parameters = {}
    intermediate = getattr(inner, "intermediate_dim", None)
    if isinstance(intermediate, int):
        inner.__dict__["intermediate_dim"] = intermediate // tp
    for name, (local, placements) in shards.items():
        shard = DTensor.from_local(local, mesh, placements, run_check=False)
        grad = weights[name].requires_grad
        owner.register_parameter(name, nn.Parameter(shard, requires_grad=grad))
        inner._parameters[name] = nn.Parameter(
            torch.empty_like(local, device="meta"), requires_grad=False
        )
    owner._inner = [inner]  # a list: not a submodule, its stand-ins not parameters


def _in_module(node: fx.Node, path: str) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return any(str(v[0]) == path for v in stack.values())


def _tensor(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def call_expert_modules(body: fx.GraphModule, paths: Iterable[str]) -> dict[str, str]:
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


def expert_tp_placements(module: nn.Module, degree: int) -> dict[str, Any] | str:
    """How tensor parallelism of degree T = ``degree`` splits a fused experts module
    Megatron-style, each TP rank holding a slice of every expert's intermediate dimension:
    parameter name -> its ``DTensor`` placement over the TP mesh; or, where the module is
    not one this split computes exactly, the reason (one line), and it stays whole.

    Hugging Face 5's experts (``use_experts_implementation``: attributes ``has_gate``,
    ``is_transposed``, ``is_concatenated``, ``has_bias``, ``has_post_expert_norm``,
    ``intermediate_dim`` = I): the up projection ``gate_up_proj`` ``[E, 2 I, H]`` (``[E, H,
    2 I]`` transposed; ``up_proj`` without a gate) is split column-wise and ``down_proj``
    ``[E, H, I]`` (``[E, I, H]``) row-wise, so a rank computes ``down_r(act(gate_r x) *
    up_r x)`` and the T partial outputs sum to the expert's. The fused ``[gate; up]`` layout
    is ``_StridedShard(dim, split_factor=2)``: a rank holds ``[gate_r; up_r]`` (the slice
    ``r`` of each half), which the model's own forward splits in two as it splits the whole;
    a plain ``Shard`` would give rank 0 all of ``gate``. The interleaved layout ``[g0, u0,
    g1, u1, ...]`` is a plain ``Shard``. Not split: biases (the down bias would be added T
    times), a norm after each expert (not linear in the partial sums), a gate function of
    its own (it may mix the intermediate features), an I that T does not divide."""
    name = type(module).__name__
    if not hasattr(module, "has_gate") or not hasattr(module, "is_transposed"):
        return f"{name} is not a Hugging Face experts module with a known weight layout"
    if getattr(module, "has_bias", False):
        return f"{name} has biases (the down projection's would be added once per TP rank)"
    if getattr(module, "has_post_expert_norm", False):
        return f"{name} normalizes each expert's output, which a sum of slices does not give"
    gate = getattr(type(module), "_apply_gate", None)
    if module.has_gate and getattr(gate, "__name__", "") != "_default_apply_gate":
        return f"{name} gates with a function of its own (it may mix intermediate features)"
    intermediate = getattr(module, "intermediate_dim", None)
    if not isinstance(intermediate, int) or intermediate % degree:
        return f"{name}'s intermediate size {intermediate} is not divisible by TP {degree}"
    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    up_size = 2 * intermediate if module.has_gate else intermediate
    transposed = bool(module.is_transposed)
    up_dim, down_dim = (2, 1) if transposed else (1, 2)
    params = dict(module.named_parameters(recurse=False))
    up, down = params.get(up_name), params.get("down_proj")
    if (
        set(params) != {up_name, "down_proj"}
        or up is None
        or down is None
        or up.dim() != 3
        or down.dim() != 3
        or up.shape[up_dim] != up_size
        or down.shape[down_dim] != intermediate
    ):
        shapes = {n: tuple(p.shape) for n, p in params.items()}
        return f"{name}'s parameters {shapes} are not the layout its attributes say"
    fused = module.has_gate and getattr(module, "is_concatenated", True)
    return {
        up_name: _StridedShard(up_dim, split_factor=2) if fused else Shard(up_dim),
        "down_proj": Shard(down_dim),
    }


def _local_slice(whole: torch.Tensor, placement: Any, degree: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s share of ``whole`` under ``placement`` (``Shard(d)``: the ``rank``-th
    of ``degree`` equal chunks of dim ``d``; ``_StridedShard(d, split_factor=s)``: the
    ``rank``-th chunk of each of the ``s`` equal parts of dim ``d``, joined), sliced here
    (every rank holds the whole already, so nothing is sent)."""
    dim = placement.dim
    parts = whole.chunk(getattr(placement, "split_factor", 1), dim)
    return torch.cat([part.chunk(degree, dim)[rank] for part in parts], dim).clone()


class TensorParallelExperts(nn.Module):
    """One TP rank's slice of every expert of a fused experts module (its parameters as the
    module's names, ``DTensor`` s placed by :func:`expert_tp_placements` over ``tp_mesh``,
    so ``full_tensor()`` and the checkpoint see the model's own layout).

    ``forward(hidden [N, H], top_k_index [N, k] int, top_k_weights [N, k]) -> [N, H]`` as
    the experts module's. The router ran on what the rank holds; each rank then needs every
    token (its slice of the experts serves them all):

    - ``tokens="sharded"`` (the experts inside a mixture-of-experts block that runs on the
      rank's sequence shard, :attr:`.sequence_parallel.SequenceLayout.token_modules`): the
      tokens, their expert ids and routing weights are all-gathered over TP, the slices'
      partial outputs reduce-scattered back to each rank's tokens: one all-gather and one
      reduce-scatter of ``[N, H]`` per layer, as a dense MLP under sequence parallelism;
    - ``tokens="replicated"`` (every rank holds every token already: the experts region
      reads values gathered for it): the partial outputs are all-reduced.

    Backward: a gathered (or replicated) input's gradient on a rank is its slice's part, so
    it is reduce-scattered (all-reduced) back, DTensor's ``Partial`` -> ``Shard`` / ``Replicate``;
    each rank's weight gradients are whole for its slice (every token passed through it),
    so the expert parameters are in no TP gradient sum."""

    _inner: list[nn.Module]
    """The model's own experts module, held outside the module tree (:func:`_hold_shards`)."""

    def __init__(
        self,
        experts: nn.Module,
        weights: Mapping[str, torch.Tensor],
        tp_mesh: Any,
        placements: Mapping[str, Any],
        tokens: str,
    ) -> None:
        """``experts``: the model's own experts module (its forward is what runs; it may be
        on the meta device); ``weights``: its parameters by name, whole (the stage's
        materialised ones), of which this rank keeps its slice; ``placements``:
        :func:`expert_tp_placements`; ``tokens``: ``"sharded"`` or ``"replicated"``."""
        super().__init__()
        if tokens not in ("sharded", "replicated"):
            raise ValueError(f"tokens must be 'sharded' or 'replicated', not {tokens!r}")
        self.tp_mesh = tp_mesh
        self.tokens = tokens
        degree, rank = int(tp_mesh.size()), int(tp_mesh.get_local_rank())
        shards = {
            name: (_local_slice(p.detach(), placements[name], degree, rank), [placements[name]])
            for name, p in weights.items()
        }
        _hold_shards(self, experts, weights, shards, tp_mesh, degree)

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        weights = {
            name: p.to_local() if isinstance(p, DTensor) else p
            for name, p in self.named_parameters(recurse=False)
        }
        # The routing weights in the dtype the experts' product computes in (a float32
        # router's against float64 tokens: float64), so the slices' partial gradients are
        # summed before they are rounded to the router's dtype, as one process rounds once.
        routing = top_k_weights.to(torch.promote_types(hidden.dtype, top_k_weights.dtype))
        mesh, layout = self.tp_mesh, self.tokens
        args = tuple(_tp_gather(x, mesh, layout) for x in (hidden, top_k_index, routing))
        part = torch.func.functional_call(self._inner[0], weights, args)
        return _tp_reduce(part, mesh, layout)


def _tp_gather(x: torch.Tensor, tp_mesh: Any, tokens: str) -> torch.Tensor:
    """Every token of the TP group: ``x`` (this rank's ``[n, ...]``) all-gathered over
    ``tp_mesh`` along dim 0 (``tokens="sharded"``), or ``x`` itself (``"replicated"``: every
    rank holds them all). A float's gradient comes back as this rank's slice's part
    (DTensor ``Partial``) and is reduce-scattered (all-reduced) to the whole."""
    if tokens == "replicated":
        held = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)
    else:
        shard = DTensor.from_local(x, tp_mesh, [Shard(0)], run_check=False)
        held = shard.redistribute(tp_mesh, [Replicate()])
    if not x.is_floating_point():
        return held.to_local()
    return held.to_local(grad_placements=[Partial()])


def _tp_reduce(part: torch.Tensor, tp_mesh: Any, tokens: str) -> torch.Tensor:
    """The sum over ``tp_mesh`` of each rank's partial ``part`` ``[N, H]`` (every token of
    the TP group): this rank's tokens of it, reduce-scattered along dim 0 (``"sharded"``),
    or all of it, all-reduced (``"replicated"``). Its backward gathers the gradient."""
    out = DTensor.from_local(part, tp_mesh, [Partial()], run_check=False)
    back = Shard(0) if tokens == "sharded" else Replicate()
    return out.redistribute(tp_mesh, [back]).to_local()


def full_layout(value: torch.Tensor) -> torch.Tensor:
    """``value`` in a layout torch.distributed.checkpoint writes: a ``DTensor`` with a
    ``_StridedShard`` placement (a fused ``[gate; up]`` split by TP, each rank holding two
    boxes of the whole) redistributed to a plain ``Shard`` of the same dim (one box per
    rank; the whole tensor is the same, the model's own layout); any other tensor as it
    is. Collective over the DTensor's mesh."""
    if not isinstance(value, DTensor) or not any(
        isinstance(p, _StridedShard) for p in value.placements
    ):
        return value
    plain = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in value.placements]
    return value.redistribute(value.device_mesh, plain)


def tp_expert_modules(
    model: nn.Module, degree: int
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """(path -> parameter placements (:func:`expert_tp_placements`) of every experts module
    of ``model`` (class name ending in ``Experts`` with ``num_experts``) that tensor
    parallelism of degree ``degree`` splits; path -> the reason of each it leaves whole,
    which then runs as any module TP does not split: whole on every rank, its gradients
    summed over TP where it sees one rank's tokens)."""
    split: dict[str, dict[str, Any]] = {}
    whole: dict[str, str] = {}
    for path, module in model.named_modules():
        if not type(module).__name__.endswith("Experts") or not hasattr(module, "num_experts"):
            continue
        placements = expert_tp_placements(module, degree)
        if isinstance(placements, str):
            whole[path] = placements
        else:
            split[path] = placements
    return split, whole


def split_experts(
    body: fx.GraphModule,
    code: Mapping[str, nn.Module],
    placements: Mapping[str, Mapping[str, Any]],
    tp_mesh: Any,
    token_modules: Iterable[str],
    ep: tuple[Any, Mapping[str, int]] | None = None,
) -> tuple[dict[str, str], dict[str, nn.Module]]:
    """Replace (in place) each experts module of ``placements`` (:func:`tp_expert_modules`)
    that the stage graph ``body`` computes by its :class:`TensorParallelExperts` over
    ``tp_mesh``, built from the model's own module (``code``) and ``body``'s weights. An
    experts region torch.export inlined becomes one call first (:func:`call_expert_modules`);
    it then reads values every TP rank holds whole (``tokens="replicated"``). Experts inside
    a module of ``token_modules`` (a mixture-of-experts block run on each rank's sequence
    shard) get that rank's tokens (``"sharded"``). Experts called some other way are left
    whole. ``ep``: with expert parallelism (EP x TP), the 2-D ``(E, T)`` mesh and each
    module's expert count: the modules are :class:`ExpertParallel` s with TP inside. Returns
    (the renamed nodes of :func:`call_expert_modules`, path -> the module put there)."""

    def caller_of(path: str, callers: set[str]) -> str | None:
        return next((c for c in callers if path == c or path.startswith(c + ".")), None)

    called = {str(n.target) for n in body.graph.nodes if n.op == "call_module"}
    # Experts inside a module the graph calls (a block on the shard) run in its forward.
    renamed = call_expert_modules(body, [p for p in placements if caller_of(p, called) is None])
    tokens_of = dict.fromkeys(token_modules, "sharded")
    callers = {str(n.target) for n in body.graph.nodes if n.op == "call_module"}
    done: dict[str, nn.Module] = {}
    for path in placements:
        caller = caller_of(path, callers)
        if caller is None or (caller != path and caller not in tokens_of):
            continue
        held = body.get_submodule(path)
        weights = dict(held.named_parameters(recurse=False))
        tokens = tokens_of.get(caller, "replicated")
        split: nn.Module
        if ep is not None:
            mesh, counts = ep
            split = ExpertParallel(
                code[path], weights, mesh, counts[path], placements[path], tokens
            )
        else:
            split = TensorParallelExperts(code[path], weights, tp_mesh, placements[path], tokens)
        body.set_submodule(path, split)
        done[path] = split
    return renamed, done
