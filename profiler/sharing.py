"""Which unit calls share one measurement: the first call of each kind is measured, every
later call that is the same computation (:mod:`autopipe.profiler.signature`) takes its
figures. Used as the ``share`` callback of :func:`autopipe.profiler.execute.run_units`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from autopipe.profiler.signature import ModuleSignatures, call_signature, graph_signature
from torch import fx


class UnitSharing:
    """``sharing(index, module, args, activation_args)`` -> the earlier unit whose outputs and
    measurement stand in for unit ``index``, or None when it must run.

    ``split``: the per-unit split graph (partitions ``submod_<i>``). Static signatures of all
    partitions are computed up front, O(nodes); each call adds O(arguments). ``enabled=False``
    records signatures but never shares.
    """

    def __init__(self, split: fx.GraphModule, *, enabled: bool = True) -> None:
        self.enabled = enabled
        modules = ModuleSignatures()
        self.static: dict[int, str] = {}
        for name, sub in split.named_children():
            if name.startswith("submod_") and isinstance(sub, fx.GraphModule):
                self.static[int(name.removeprefix("submod_"))] = graph_signature(
                    sub.graph.nodes, sub, modules
                )
        self._kinds = Counter(self.static.values())
        self._first: dict[str, int] = {}
        self.signatures: dict[int, str] = {}
        """Call signature of every unit seen, by unit index."""

    def copies(self, index: int) -> int:
        """How many units have the same graph as unit ``index`` (an upper bound on how many
        will share its measurement, known before any unit runs)."""
        return self._kinds[self.static.get(index, "")] or 1

    def expected_runs(self, num_units: int) -> int:
        """How many of the ``num_units`` units will run, as known before any runs: one per
        distinct graph when sharing (a lower bound: calls of one graph on inputs of other
        shapes run apart), every unit when not. O(units)."""
        if not self.enabled:
            return num_units
        return len(self._kinds) + max(num_units - len(self.static), 0)

    def __call__(
        self, index: int, module: fx.GraphModule, args: tuple[Any, ...], flags: tuple[bool, ...]
    ) -> int | None:
        sig = call_signature(self.static.get(index, str(index)), args, flags)
        self.signatures[index] = sig
        if not self.enabled:
            return None
        first = self._first.setdefault(sig, index)
        return None if first == index else first
