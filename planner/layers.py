"""A plan's units read as a transformer: what comes before the stack of layers, the layers,
and what comes after. Torch-free; works on unit names alone.

The frameworks that ask for a split by hand count *layers*: torchtitan's
``module_fqns_per_model_part`` and its even split, Megatron-Core's layout string (``E``
embedding, ``t`` decoder layer, ``L`` loss/head) and its uniform split. Units are module
paths (``model.embed_tokens``, ``model.layers.0`` ... ``model.layers.31``, ``model.norm``,
``lm_head``), so the layers are the run of units named ``PREFIX.0``, ``PREFIX.1``, ... with
one prefix. O(units).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LayerStack", "block_runs", "layer_stack"]

_INDEXED = re.compile(r"^(?P<prefix>.+)\.(?P<index>\d+)$")


@dataclass(frozen=True)
class LayerStack:
    """Units ``[0, start)`` come before the layers, ``[start, end)`` are the layers in order
    (``prefix.0`` ...), ``[end, N)`` come after."""

    prefix: str
    start: int
    end: int
    num_units: int

    @property
    def num_layers(self) -> int:
        return self.end - self.start


def block_runs(unit_names: Sequence[str]) -> list[tuple[str, int, int]]:
    """Every maximal run of consecutive units ``P.i, P.i+1, ...`` (one prefix ``P``, indices
    counting up by one from 0), as ``(P, start, end)``, runs of one unit left out."""
    runs: list[tuple[str, int, int]] = []
    i = 0
    while i < len(unit_names):
        match = _INDEXED.match(unit_names[i])
        if match is None or int(match["index"]) != 0:
            i += 1
            continue
        prefix, j = match["prefix"], i + 1
        while j < len(unit_names) and unit_names[j] == f"{prefix}.{j - i}":
            j += 1
        if j - i >= 2:
            runs.append((prefix, i, j))
        i = j
    return runs


def layer_stack(unit_names: Sequence[str]) -> LayerStack | None:
    """The one stack of layers of a GPT-like unit list, or None when there is none or more
    than one (an encoder-decoder has two)."""
    runs = block_runs(unit_names)
    if len(runs) != 1:
        return None
    prefix, start, end = runs[0]
    return LayerStack(prefix, start, end, len(unit_names))
