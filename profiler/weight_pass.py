"""Which parameters torch's split weight pass cannot take: those used more than once.

The zero-bubble schedules split a backward into B (the inputs' gradient) and W (the
parameters'), torch's ``stage_backward_input`` / ``stage_backward_weight``
(``torch.distributed.pipelining._backward``). B remembers, for each parameter, the nodes of
the autograd graph where the parameter's path meets the path from the inputs; W then runs
one ``autograd.grad`` per group of parameters from those nodes, freeing the graph as it goes.
A parameter used twice along the inputs' path (one layer applied several times, ALBERT's
shared layer, a block called in a loop) meets it at two nodes, and the pass from the later
one walks back through the earlier use, freeing nodes another group still needs: "Trying to
backward through the graph a second time". Such a piece of the model (a profiled unit, a
runtime chunk) runs its backward unsplit: B does all of it, W nothing.

:func:`reused_parameters` finds those parameters on an autograd graph already built (a real
or a fake-tensor forward), walking only the parameters' own sub-graphs up to where they meet
the inputs' path: O(graph) for the inputs' side plus O(the parameters' sub-graphs).
Conservative: a parameter met twice is reported even where torch's grouping would happen to
merge the two uses into one pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch.autograd.graph import Node

__all__ = ["accumulator", "reuse_reason", "reused_parameters"]


def accumulator(t: torch.Tensor) -> Node | None:
    """The autograd node gradients of ``t`` flow into: its ``grad_fn``, or, for a leaf that
    needs a gradient, its ``AccumulateGrad``; None for a tensor that needs none."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    # A leaf's accumulator is created lazily: a view's backward edge points at it.
    view = t.view_as(t)
    assert view.grad_fn is not None
    return view.grad_fn.next_functions[0][0]


def _consumers(roots: Iterable[Node]) -> dict[Node, list[Node]]:
    """For every node reachable from ``roots`` (along ``next_functions``), the nodes that
    take its gradient from it (its users in the forward), each listed once. O(graph)."""
    users: dict[Node, list[Node]] = {}
    seen: set[Node] = set()
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            listed = users.setdefault(child, [])
            if node not in listed:
                listed.append(node)
            stack.append(child)
    return users


def reused_parameters(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    parameters: Mapping[str, torch.Tensor],
) -> dict[str, int]:
    """``{name: uses}`` of the ``parameters`` that meet the inputs' path at more than one node
    of the autograd graph of ``outputs`` (a parameter used ``uses`` times; see the module
    docstring). ``inputs``: the piece's inputs as passed (only those that need a gradient
    count); with none, torch runs the whole backward in W and nothing is reported."""
    roots = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    sources = [accumulator(t) for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    starts = [s for s in sources if s is not None]
    if not roots or not starts:
        return {}
    users = _consumers(roots)
    # The inputs' path: every node that depends on an input that needs a gradient.
    on_path: set[Node] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node in on_path:
            continue
        on_path.add(node)
        stack += users.get(node, [])
    found: dict[str, int] = {}
    for name, p in parameters.items():
        acc = accumulator(p) if p.requires_grad else None
        if acc is None or acc not in users:
            continue
        meets: set[Node] = set()
        seen: set[Node] = set()
        stack = [acc]
        while stack:  # the parameter's own sub-graph, up to where it meets the inputs' path
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in on_path:
                meets.add(node)
                continue
            stack += users.get(node, [])
        if len(meets) > 1:
            found[name] = len(meets)
    return found


def reuse_reason(reused: Mapping[str, int], where: str = "unit") -> str:
    """One line naming the first reused parameter (and how many more), for a profile's
    ``UnitProfile.backward_unsplit`` or a runtime's ``unsplit_chunks``; "" when none."""
    if not reused:
        return ""
    name = sorted(reused)[0]
    more = f" (and {len(reused) - 1} more)" if len(reused) > 1 else ""
    return (
        f"parameter {name!r}{more} is used {reused[name]} times in the {where}; torch's split "
        "weight pass cannot take a parameter used more than once, so its backward runs unsplit"
    )
