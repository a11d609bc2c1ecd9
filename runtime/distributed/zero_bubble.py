"""What the zero-bubble schedules need from a chunk, checked before it runs.

``interleaved-zb``, ``zbv`` and ``dualpipev`` run a chunk's backward as two actions. Without a
``dw_builder``, ``PipelineStage`` does it by walking the autograd graph
(``torch.distributed.pipelining._backward``): B computes the gradient of the chunk's inputs
and keeps, for each parameter, the gradient arriving at the nodes where the parameter's path
meets the path from the inputs; W later runs autograd from those nodes to the parameters.
The first chunk (no input gradient to send) runs its whole backward in W.

Two things this does not cover, both handled here:

- A parameter whose contribution reaches a chunk output *without* meeting an input that needs
  a gradient (a position embedding computed from ``arange`` and handed on as its own output,
  or a chunk whose inputs need no gradient at all) gets no gradient from W: torch gives it
  silently wrong (missing) gradients. :func:`weight_pass_misses` finds such parameters from a
  fake-tensor forward of the chunk (no data, no compute) and the runtime then runs that
  chunk's backward unsplit (its B does everything, its W nothing: correct gradients, a
  smaller bubble filler).
- B detaches the chunk's outputs in place, which autograd refuses for views
  ("Can't detach views in-place"): :class:`~autopipe.runtime.distributed.stages.StageModule`
  copies output views for these schedules (``own_outputs``).

A chunk that uses a parameter more than once (a layer applied several times, e.g. two calls
of ALBERT's shared layer in one chunk) makes torch's weight pass fail ("Trying to backward
through the graph a second time"): :func:`weight_pass_reuses` finds such parameters
(:func:`autopipe.profiler.weight_pass.reused_parameters`, on a fake-tensor forward) and the
chunk runs unsplit as well.

Re-materialized chunks run unsplit too: ``torch.utils.checkpoint`` (non-reentrant)
recomputes per autograd pass, and torch's weight pass makes one pass per parameter group,
so a split checkpointed chunk would recompute (parts of) its forward in B and then again
for every group in W (a transformer block measured: 4 Linear calls in forward, 3 more in B,
18 more in W). Unsplit, it recomputes once, in B, and its W is empty. The runtime lists
such chunks, with the reason, in ``DistributedPipeline.unsplit_chunks``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from autopipe.profiler.weight_pass import accumulator as _accumulator
from autopipe.profiler.weight_pass import reused_parameters
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import Node

__all__ = ["weight_pass_misses", "weight_pass_reuses"]


def _fake_forward(
    module: nn.Module, example_inputs: Sequence[torch.Tensor]
) -> tuple[list[Any], list[Any]]:
    """``module``'s forward on fake copies of ``example_inputs`` (``requires_grad`` kept):
    ``(fake inputs, output leaves)``, with their autograd graph. No compute."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, torch.enable_grad():
        fakes = [
            mode.from_tensor(t.detach()).requires_grad_(t.requires_grad)
            if isinstance(t, torch.Tensor)
            else t
            for t in example_inputs
        ]
        out = module(*fakes)
    return fakes, list(torch.utils._pytree.tree_leaves(out))


def weight_pass_reuses(module: nn.Module, example_inputs: Sequence[torch.Tensor]) -> dict[str, int]:
    """``{name: uses}`` of ``module``'s trainable parameters used more than once along the
    path from its inputs, which torch's split weight pass cannot take (see the module
    docstring); ``example_inputs`` as in :func:`weight_pass_misses`. Runs the forward once on
    fake tensors. Raises what the forward raises on fake tensors."""
    params = {name: p for name, p in module.named_parameters() if p.requires_grad}
    if not params:
        return {}
    fakes, leaves = _fake_forward(module, example_inputs)
    outputs = [t for t in leaves if isinstance(t, torch.Tensor)]
    return reused_parameters(outputs, [t for t in fakes if isinstance(t, torch.Tensor)], params)


def _depends_on(roots: Iterable[Node], targets: set[Node]) -> set[Node]:
    """The nodes reachable from ``roots`` (following ``next_functions``) from which one of
    ``targets`` is reachable: the part of the graph that depends on the targets. O(graph)."""
    depends: set[Node] = set()
    done: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if node in done:
            continue
        children = [n for n, _ in node.next_functions if n is not None]
        if not expanded:
            stack.append((node, True))
            stack += [(c, False) for c in children if c not in done]
            continue
        done.add(node)
        if node in targets or any(c in depends for c in children):
            depends.add(node)
    return depends


def _reached_avoiding(roots: Iterable[Node], avoid: set[Node]) -> set[Node]:
    """The nodes reachable from ``roots`` along paths that never enter ``avoid``."""
    seen: set[Node] = set()
    stack = [r for r in roots if r not in avoid]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack += [n for n, _ in node.next_functions if n is not None and n not in avoid]
    return seen


def weight_pass_misses(
    module: nn.Module, example_inputs: Sequence[torch.Tensor], last: bool = False
) -> list[str]:
    """Names of ``module``'s trainable parameters whose gradient the zero-bubble weight pass
    would miss, wholly or in part, for a chunk that is not the first.

    ``example_inputs``: the chunk's inputs as they arrive (shapes, dtypes and
    ``requires_grad`` matter, values do not; they are replaced by fake tensors). ``last``: the
    chunk computes the loss, which joins all its outputs, so only "no output depends on an
    input that needs a gradient" can miss. Runs the chunk's forward once on fake tensors
    (``FakeTensorMode``: no compute). Raises what the forward raises on fake tensors.
    """
    params = {_accumulator(p): name for name, p in module.named_parameters() if p.requires_grad}
    params.pop(None, None)
    if not params:
        return []
    fakes, leaves = _fake_forward(module, example_inputs)
    roots = [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn]
    inputs = {_accumulator(t) for t in fakes if isinstance(t, torch.Tensor)}
    inputs.discard(None)
    joined = _depends_on(roots, {n for n in inputs if n is not None})
    if last:
        # The loss joins every output: a parameter meets the inputs there at the latest,
        # provided some output depends on an input that needs a gradient.
        if any(r in joined for r in roots):
            return []
        return sorted(params.values())
    missed = _reached_avoiding(roots, joined)
    return sorted(name for node, name in params.items() if node in missed)
