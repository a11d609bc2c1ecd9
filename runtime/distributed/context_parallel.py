"""Context parallelism (C > 1): each sample's sequence split over C ranks, with torch's own
``torch.distributed.tensor.experimental.context_parallel`` (ring attention).

The mesh is torchtitan's ``(pp, dp, cp, tp)``, outermost first (:func:`build_context_mesh`):
rank = ((pp * D + dp) * C + cp) * T + tp. A CP rank sees only its share of every sequence, so
each parameter's gradient is the sum over the ``dp x cp`` ranks (the flattened ``dp_cp``
group, :func:`gradient_mesh`: the plain gradient all-reduce, or FSDP2's reduce-scatter
over it).

What the runtime does for C > 1, and why:

1. The stages are traced at one CP rank's sequence length ``S / C``
   (:func:`local_sequence_inputs`): torch.export writes every size it saw as a number, so a
   graph traced at ``S`` would reshape a rank's ``[b, S / C, h]`` to ``S``.
2. The positions travel as an input (``position_ids``, :func:`context_batch`): a model that
   numbers its tokens itself (``arange``) would give every CP rank positions ``0 .. S/C - 1``;
   torch shards them with the inputs, in the same load-balanced order.
3. Attention runs as ``is_causal`` with no mask (:func:`route_attention`): torch's ring
   attention takes no ``attn_mask``. The mask a traced Hugging Face model builds from sizes
   alone is checked to be the plain causal mask (evaluated once) and dropped; a mask that
   reads the data (padding) or is not causal (sliding window, bidirectional) is refused.
   The rewritten call looks ``torch.nn.functional.scaled_dot_product_attention`` up when it
   runs, which is what ``context_parallel`` patches.
4. A causal LM's labels are shifted before the sequence is split (:func:`context_batch`):
   the model's own loss shifts within the tensor it is given, which under CP is one rank's
   load-balanced share (head and tail chunks), so it would pair tokens of different chunks.
   The model runs without ``labels`` and :func:`shifted_token_loss` is the objective: the
   cross-entropy summed over the valid shifted labels of the rank's share, with their count
   (the runtime divides by the global count: the model's own mean over the whole batch).
5. With tensor parallelism (C x T) the stages are traced again at one TP rank's shapes
   (``DistributedPipeline``) with the same attention rewrite: TP splits the heads (q, k, v
   are the rank's heads of its sequence share, which sequence parallelism splits over T
   between the blocks), CP the sequence; k and v are exchanged over ``mesh["cp"]``, each
   TP rank for its own heads.
6. Each step runs inside ``context_parallel(mesh["cp"], buffers=..., buffer_seq_dims=...)``
   (:func:`sharded_step`): the inputs, positions and shifted labels (every tensor whose
   dim 1 is the sequence) are sharded in place with torch's head-tail load balancer, and
   SDPA is patched for the forward and backward of every micro-batch.

What cannot run on gloo / CPU (torch 2.13): ring attention. ``context_parallel`` turns q, k,
v into DTensors sharded on the sequence and maps ``aten._scaled_dot_product_{flash,
efficient,cudnn}_attention`` (and their backwards) to its ring implementation; on the CPU,
SDPA calls ``aten._scaled_dot_product_flash_attention_for_cpu``
(:data:`CPU_ATTENTION_KERNEL`), for which DTensor has no sharding strategy ("Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered"). Off CUDA the runtime therefore runs the same ``context_parallel`` (the
buffers sharded, in order: torch's load balancer off) with :func:`gathered_attention` in
place of the ring (:func:`sharded_step`): the same sharded inputs, positions, labels, loss
and gradient reduction, with k and v all-gathered by DTensor instead of passed round the
ring. (Torch's own MATH SDPA on the sequence-sharded DTensors is no such stand-in: DTensor's
sharding propagation may pick a replicated output, measured at s = 64, d = 64, which
``context_parallel`` then hands back whole.)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.device_mesh import init_device_mesh

__all__ = [
    "CONTEXT_MESH_DIM_NAMES",
    "CPU_ATTENTION_KERNEL",
    "causal_attention",
    "context_batch",
    "context_mesh_shape",
    "AttentionMaskError",
    "accepts_positions",
    "build_context_mesh",
    "context_rank_of",
    "gathered_attention",
    "gradient_mesh",
    "length_problem",
    "positions_problem",
    "sequence_length",
    "world_size_problem",
    "local_sequence_inputs",
    "route_attention",
    "sequence_buffers",
    "sharded_step",
    "shifted_token_loss",
]

CONTEXT_MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")
"""The mesh of a plan with C > 1, outermost first, as torchtitan lays it out."""

CPU_ATTENTION_KERNEL = "aten._scaled_dot_product_flash_attention_for_cpu"
"""The SDPA kernel the CPU runs, which torch's context_parallel does not shard."""

IGNORE_INDEX = -100
"""The label Hugging Face's losses skip (and what pads the last shifted label)."""

SEQUENCE_DIM = 1
"""The sequence dimension of the batch tensors (``[b, s]`` ids, positions, labels)."""

_SDPA = (torch.ops.aten.scaled_dot_product_attention.default,)


def context_mesh_shape(plan: Any) -> tuple[int, int, int, int]:
    """``(K, D, C, T)``: the plan's mesh with its cp dimension (:data:`CONTEXT_MESH_DIM_NAMES`)."""
    return (plan.num_stages, plan.data_parallel, plan.context_parallel, plan.tensor_parallel)


def build_context_mesh(plan: Any, device_type: str) -> Any:
    """``init_device_mesh(device_type, (K, D, C, T), ("pp", "dp", "cp", "tp"))``. The
    caller has checked the world size."""
    return init_device_mesh(
        device_type, context_mesh_shape(plan), mesh_dim_names=CONTEXT_MESH_DIM_NAMES
    )


def gradient_mesh(mesh: Any) -> Any:
    """The ``dp`` and ``cp`` dimensions of ``mesh`` flattened into one (``dp_cp``): the
    ranks a parameter's gradient is summed over (or FSDP2 shards it over). Call once per
    mesh and keep it (torch deprecates slicing a flattened dimension from the root)."""
    return mesh["dp", "cp"]._flatten("dp_cp")


def accepts_positions(model: nn.Module) -> bool:
    """Whether ``model``'s forward takes ``position_ids`` (Hugging Face's name)."""
    try:
        return "position_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def context_batch(batch: Any, positions: bool, shift: bool, target: bool = False) -> Any:
    """``batch`` (a dict of ``[b, s]`` tensors: the model's keyword inputs) made ready to be
    split over the sequence: ``position_ids`` ``[b, s]`` (``0 .. s - 1``) added when
    ``positions`` and absent; with ``shift`` (a causal LM's loss), ``labels`` dropped (the
    model runs without its loss) and, for a ``target`` (what the loss reads), replaced by
    ``shift_labels`` (``labels[:, t + 1]`` at ``t``, :data:`IGNORE_INDEX` at the end). Other
    batches are returned as they are."""
    if not isinstance(batch, Mapping):
        return batch
    out = dict(batch)
    ids = out.get("input_ids")
    if positions and "position_ids" not in out and isinstance(ids, torch.Tensor):
        s = ids.shape[SEQUENCE_DIM]
        out["position_ids"] = torch.arange(s, device=ids.device).expand(ids.shape[0], s)
    labels = out.pop("labels", None) if shift else None
    if target and isinstance(labels, torch.Tensor):
        pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
        out["shift_labels"] = torch.cat([labels[:, 1:], pad], dim=SEQUENCE_DIM)
    return out


def positions_problem(batch: Any) -> str | None:
    """The one-line refusal of a batch whose ``position_ids`` are not ``0 .. s - 1`` in
    every row (packed sequences): ring attention runs one causal mask over the whole row."""
    positions = batch.get("position_ids") if isinstance(batch, Mapping) else None
    if not isinstance(positions, torch.Tensor):
        return None
    s = positions.shape[-1]
    if bool((positions == torch.arange(s, device=positions.device)).all()):
        return None
    return (
        "context parallelism runs one causal mask over each row, but the batch's "
        "position_ids are not 0 .. s - 1 (packed sequences); pass no position_ids or "
        "re-plan with --context-parallel 1"
    )


def local_sequence_inputs(batch: Any, degree: int) -> Any:
    """``batch`` with every tensor of :func:`sequence_buffers` cut to its first
    ``s / degree`` positions: one CP rank's shapes, for tracing (the values do not matter)."""
    length = sequence_length(batch)
    if length is None:
        return batch
    return torch.utils._pytree.tree_map(
        lambda t: (
            t.narrow(SEQUENCE_DIM, 0, length // degree).contiguous()
            if _is_sequence(t, length)
            else t
        ),
        batch,
    )


def sequence_length(batch: Any) -> int | None:
    """The sequence length ``s`` of ``batch``: dim 1 of its ``input_ids`` (or of its first
    tensor with two or more dims); None when it has none."""
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        return int(batch["input_ids"].shape[SEQUENCE_DIM])
    for t in torch.utils._pytree.tree_leaves(batch):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[SEQUENCE_DIM])
    return None


def _is_sequence(t: Any, length: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[SEQUENCE_DIM] == length


def sequence_buffers(trees: Sequence[Any], length: int) -> list[torch.Tensor]:
    """Every tensor of ``trees`` whose dim 1 is the sequence (``length``), each once: what
    ``context_parallel`` shards."""
    found: dict[int, torch.Tensor] = {}
    for tree in trees:
        for t in torch.utils._pytree.tree_leaves(tree):
            if _is_sequence(t, length):
                found.setdefault(id(t), t)
    return list(found.values())


def length_problem(length: int, degree: int) -> str | None:
    """The one-line refusal of a sequence of ``length`` split over ``degree`` ranks: torch's
    head-tail load balancer cuts it into ``2 * degree`` equal chunks."""
    if length % (2 * degree):
        return (
            f"the sequence length {length} is not divisible by 2 x context parallelism "
            f"{degree} (torch's load balancer gives each rank a head and a tail chunk); "
            f"use a length that is a multiple of {2 * degree}"
        )
    return None


@contextlib.contextmanager
def sharded_step(
    cp_mesh: Any,
    buffers: Sequence[torch.Tensor],
    device_type: str = "cuda",
    seq_dims: Sequence[int] | None = None,
) -> Iterator[None]:
    """A block in which ``buffers`` (``[b, s, ...]``, or their sequence on ``seq_dims``;
    this rank's own copies) hold this CP
    rank's share of the sequence and SDPA runs over ``cp_mesh``: torch's
    ``context_parallel``, around the forward and backward of every micro-batch of a step.
    The buffers are not restored (the step is done with them).

    On CUDA: ring attention, each rank's share load-balanced (head and tail chunks). On
    another device (gloo on the CPU), where ring attention has no kernel (module docstring),
    the same ``context_parallel`` shards the buffers, with torch's load balancer off (each
    rank's share in order), and SDPA runs as :func:`gathered_attention`: each rank's queries
    against k and v all-gathered by DTensor (whose backward reduce-scatters their
    gradients). Exact, not ring attention: k and v are gathered whole."""
    from torch.distributed.tensor.experimental import context_parallel

    # The switch of torch's default head-tail load balancer (gathered attention's causal
    # mask takes each rank's share in the sequence's order).
    from torch.distributed.tensor.experimental._attention import _cp_options

    functional = torch.nn.functional
    plain = functional.scaled_dot_product_attention
    with contextlib.ExitStack() as stack:
        ring = device_type == "cuda"
        if not ring:
            balanced = _cp_options.enable_load_balance
            _cp_options.enable_load_balance = False
            stack.callback(setattr, _cp_options, "enable_load_balance", balanced)
        stack.enter_context(
            context_parallel(
                cp_mesh,
                buffers=list(buffers),
                buffer_seq_dims=list(seq_dims or [SEQUENCE_DIM] * len(buffers)),
                no_restore_buffers=set(buffers),
            )
        )
        if not ring:  # in place of the ring attention context_parallel patched in
            patched = functional.scaled_dot_product_attention
            functional.scaled_dot_product_attention = functools.partial(
                gathered_attention, cp_mesh, plain
            )
            stack.callback(setattr, functional, "scaled_dot_product_attention", patched)
        yield


def gathered_attention(
    cp_mesh: Any,
    sdpa: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Causal attention of this CP rank's queries ``[b, heads, s / C, d]`` (the rank's share
    in the sequence's order) against the whole sequence's keys and values, gathered over
    ``cp_mesh`` by DTensor (``Shard(2)`` -> ``full_tensor``, whose backward reduce-scatters
    the ranks' gradients of them); ``sdpa``: torch's own SDPA.
    The CPU's stand-in for ring attention (:func:`sharded_step`)."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    if attn_mask is not None or not is_causal:
        raise ValueError("context parallelism runs causal attention without a mask")
    # Each rank's gradient of the gathered k and v is its own queries' part: Partial, so the
    # backward sums them (reduce-scatter) rather than taking one rank's as the whole.
    keys, values = (
        DTensor.from_local(t.contiguous(), cp_mesh, [Shard(2)], run_check=False).full_tensor(
            grad_placements=[Partial()]
        )
        for t in (key, value)
    )
    local, whole = query.shape[2], keys.shape[2]
    first = cp_mesh.get_local_rank() * local
    rows = torch.arange(first, first + local, device=query.device)
    mask = torch.arange(whole, device=query.device)[None, :] <= rows[:, None]
    return sdpa(
        query,
        keys,
        values,
        attn_mask=mask,
        dropout_p=dropout_p,
        scale=scale,
        enable_gqa=enable_gqa,
    )


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Causal SDPA, ``[b, heads, s, d]`` in and out, through
    ``torch.nn.functional.scaled_dot_product_attention`` as found when called (the function
    ``context_parallel`` replaces with its ring attention)."""
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=enable_gqa
    )


class AttentionMaskError(ValueError):
    """An attention call that torch's context_parallel cannot take (one line)."""


def _ancestors(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node it depends on, in graph order."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _mask_value(gm: fx.GraphModule, mask: fx.Node, flat_inputs: Sequence[Any]) -> torch.Tensor:
    """The value of ``mask`` for ``flat_inputs`` (the graph's placeholder values), computed by
    the part of ``gm`` it depends on; :class:`AttentionMaskError` when that part reads a
    parameter or an input's data rather than its size. The positions may be read (Hugging
    Face masks tokens by position, and splits packed sequences where positions restart):
    :func:`context_batch` gives every row ``0 .. s - 1``, for which that mask is the
    causal one, and :func:`positions_problem` refuses any other."""
    needed = _ancestors(mask)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in needed:
        if n.op in ("get_attr", "call_module"):
            raise AttentionMaskError(f"the attention mask {mask.name} reads the model's state")
        if n.op == "placeholder" and n.name != "position_ids":
            data_users = [
                u
                for u in n.users
                if u in needed and not (u.op == "call_function" and "sym_size" in str(u.target))
            ]
            if data_users:
                raise AttentionMaskError(
                    f"the attention mask {mask.name} reads the input {n.name} (e.g. padding)"
                )
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in placeholders:
        env[n] = graph.placeholder(n.name)
    for n in needed:
        if n.op != "placeholder":
            env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(env[mask])
    return fx.GraphModule(gm, graph)(*flat_inputs)


def route_attention(gm: fx.GraphModule, flat_inputs: Sequence[Any]) -> dict[str, str]:
    """Rewrite each SDPA call of ``gm`` (in place) into :func:`causal_attention` (no mask,
    ``is_causal``), what torch's ring attention runs. A call with a mask is rewritten only
    when the mask is the plain causal one, worked out from the inputs' sizes alone
    (``flat_inputs``: values for ``gm``'s placeholders); else :class:`AttentionMaskError`.
    Returns the name of each new call -> the name of the call it replaced."""
    rewritten: dict[str, str] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        given = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
        mask = given.get("attn_mask")
        if isinstance(mask, fx.Node):
            value = _mask_value(gm, mask, flat_inputs).to(torch.bool)
            q, k = given["query"].meta.get("val"), given["key"].meta.get("val")
            s_q = int(q.shape[-2]) if q is not None else value.shape[-2]
            s_k = int(k.shape[-2]) if k is not None else value.shape[-1]
            causal = torch.ones(s_q, s_k, dtype=torch.bool).tril()
            if value.shape[-2:] != causal.shape or not bool((value == causal).all()):
                raise AttentionMaskError(
                    f"attention {node.name} has a mask that is not the plain causal one "
                    "(sliding window, bidirectional or padded)"
                )
        elif not given.get("is_causal", False):
            raise AttentionMaskError(f"attention {node.name} is not causal")
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(
                causal_attention,
                (given["query"], given["key"], given["value"]),
                {
                    k: given[k]
                    for k in ("dropout_p", "scale", "enable_gqa")
                    if k in given and given[k] is not None
                },
            )
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        rewritten[call.name] = node.name
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return rewritten


def _logits(output: Any) -> torch.Tensor:
    """The logits ``[b, s, vocab]`` of a model's output (a ModelOutput, dict or tensor)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    found = getattr(output, "logits", None)
    if isinstance(found, torch.Tensor):
        return found
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find the logits in a {type(output).__name__}")


def shifted_token_loss(output: Any, target: Any) -> tuple[torch.Tensor, float]:
    """A causal LM's loss on one CP rank's share: the cross-entropy of the logits
    ``[b, s / C, vocab]`` against ``target["shift_labels"]`` (:func:`context_batch`), summed
    over the labels that are not :data:`IGNORE_INDEX`, and their count (``(sum, count)``)."""
    logits = _logits(output)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # half: upcast
    labels = target["shift_labels"]
    total = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return total, float((labels != IGNORE_INDEX).sum())


def context_rank_of(rank: int, shape: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """``(pp, dp, cp, tp)`` coordinates of global ``rank`` on a mesh of ``shape``."""
    k, d, c, t = shape
    del k
    return (rank // (d * c * t), rank // (c * t) % d, rank // t % c, rank % t)


def world_size_problem(plan: Any, world_size: int) -> str | None:
    """The one-line refusal of a C > 1 plan launched on ``world_size`` processes, or None."""
    if world_size == plan.world_size:
        return None
    pp, dp, cp, tp = context_mesh_shape(plan)
    return (
        f"the plan's mesh is pp {pp} x dp {dp} x cp {cp} x tp {tp} = {plan.world_size} "
        f"processes but {world_size} were launched; launch {plan.world_size} (torchrun "
        f"--nproc-per-node {plan.world_size}) or re-plan for {world_size} GPUs"
    )
