"""Count a stack of repeated blocks once: trace and count a shortened copy of the model.

Analytic profiling traces the model (``torch.export`` for most Hugging Face models, seconds
per dozen layers) and runs every op on meta; both grow with depth. A stack of identical
blocks costs the same per block, so the model is traced and counted with its block
container cut down to ``head + 3 x period`` blocks, and the counted units are repeated:

* the container's children have *structure signatures* (class, parameter and buffer shapes
  and dtypes, children; no plain attributes such as ``layer_idx``); the smallest ``period``
  T and ``head`` s with ``sig[i] == sig[i + T]`` for every ``i >= s`` (and a whole number
  of periods after the head) describe it: s = 0, T = 1 for a decoder stack; s = 1 for T5,
  whose first block holds the relative position bias;
* the shortened model keeps blocks ``0 .. s + 3T - 1``: the head, a first period (after
  the head, as in the model), a middle period (blocks on both sides, as most blocks have)
  and a last period (followed by what follows the stack). After tracing it, the three
  periods' graphs must match node for node (targets, constants, recorded shapes): if not,
  the blocks are not context-free copies and the whole model is counted instead;
* full blocks in the head and the first period are counted as themselves, blocks in the
  last period as the last counted period, every other block as the middle period; the cut
  after a block is the cut after the counted block it is counted as (the middle period's
  last block is followed by the last period, like every block before the model's last
  period).

Every figure is then what counting the whole model gives (tested field by field against the
full count on GPT, Llama, Qwen2, Mixtral and GPT-2 configurations), at the cost of
``s + 3T`` blocks. The middle period matters: a value every block reads (the encoder output
in T5's decoder, rotary tables) gets its gradient summed in backward, an add that only
blocks with a later reader run.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

from autopipe.profiler.signature import ModuleSignatures, graph_signature
from autopipe.profiler.units import UnitGraph, _block_container
from torch import nn

from autopipe.core.profile import Profile
from autopipe.core.profile_records import CountedBlocks


class _StructureSignatures(ModuleSignatures):
    """Module structure without plain attributes (a block's ``layer_idx`` differs per copy
    but, in a traced graph, only the graph says whether it changes the computation)."""

    def __call__(self, module: nn.Module) -> str:
        key = id(module)
        found = self._memo.get(key)
        if found is None:
            shape = [
                (name, tuple(t.shape), str(t.dtype))
                for name, t in [
                    *module.named_parameters(recurse=False),
                    *module.named_buffers(recurse=False),
                ]
                if t is not None
            ]
            cls = type(module)
            children = [(n, self(c)) for n, c in module.named_children()]
            found = self._memo[key] = repr(
                (f"{cls.__module__}.{cls.__qualname__}", module.training, shape, children)
            )
        return found


@dataclasses.dataclass(frozen=True)
class BlockReduction:
    """The block container at ``path`` (``length`` children) counted as its first
    ``head + 2 * period`` children."""

    path: str
    length: int
    head: int
    period: int

    @property
    def kept(self) -> int:
        return self.head + 3 * self.period

    def counted_block(self, i: int) -> int:
        """The counted block whose figures full block ``i`` takes."""
        s, t, n = self.head, self.period, self.length
        if i < s + t:
            return i
        if i >= n - t:
            return s + 2 * t + (i - (n - t))
        return s + t + (i - s) % t

    def counted_cut(self, i: int) -> int:
        """The counted block whose following cut stands for the cut after full block ``i``."""
        return self.counted_block(i)


def find_block_reduction(model: nn.Module) -> BlockReduction | None:
    """The reduction of ``model``'s block container, or None when there is nothing to gain
    (no container, not more blocks than ``head + 3 * period``, or a container type whose
    shortened copy might behave differently). O(parameters + blocks^2)."""
    path = _block_container(model)
    if not path:
        return None
    container = model.get_submodule(path)
    if type(container) not in (nn.ModuleList, nn.Sequential):
        return None
    blocks = list(container.children())
    signatures = _StructureSignatures()
    sig = [signatures(b) for b in blocks]
    n = len(sig)
    best: tuple[int, int] | None = None
    for period in range(1, n // 3 + 1):
        for head in range(0, n - 3 * period + 1):
            if (n - head) % period == 0 and all(
                sig[i] == sig[i + period] for i in range(head, n - period)
            ):
                if best is None or head + 3 * period < best[0] + 3 * best[1]:
                    best = (head, period)
                break
    if best is None or best[0] + 3 * best[1] >= n:
        return None
    return BlockReduction(path, n, best[0], best[1])


@contextlib.contextmanager
def shortened(model: nn.Module, reduction: BlockReduction) -> Iterator[None]:
    """``model`` with its block container holding only the counted blocks, restored after."""
    parent_path, _, name = reduction.path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    original = parent._modules[name]
    assert original is not None
    kept = list(original.children())[: reduction.kept]
    parent._modules[name] = (
        type(original)(*kept) if isinstance(original, nn.Sequential) else (nn.ModuleList(kept))
    )
    try:
        yield
    finally:
        parent._modules[name] = original


def still_the_blocks(model: nn.Module, reduction: BlockReduction) -> bool:
    """Whether the shortened ``model`` still has ``reduction.path`` as its block container
    (with fewer blocks another stack, e.g. T5's encoder, could outweigh it)."""
    return _block_container(model) == reduction.path


def block_units(ug: UnitGraph, reduction: BlockReduction) -> int | None:
    """Index of the first block unit in the shortened trace when the counted blocks are
    exactly the consecutive units ``path.0 .. path.(kept-1)``; else None."""
    names = [f"{reduction.path}.{i}" for i in range(reduction.kept)]
    try:
        first = ug.unit_names.index(names[0])
    except ValueError:
        return None
    return first if ug.unit_names[first : first + len(names)] == names else None


def periods_match(ug: UnitGraph, reduction: BlockReduction, first: int) -> bool:
    """Whether the three counted periods are the same graphs (then every block of the model
    is, by the structure signatures). O(nodes of the counted blocks)."""
    modules = ModuleSignatures()
    gm = ug.graph_module
    by_unit: dict[int, list[Any]] = {}
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "get_attr", "output"):
            by_unit.setdefault(ug.node_unit[node.name], []).append(node)
    s, t = reduction.head, reduction.period
    for j in range(t):
        kinds = {
            graph_signature(by_unit.get(first + s + k * t + j, []), gm, modules) for k in range(3)
        }
        if len(kinds) != 1:
            return False
    return True


def expand_profile(
    profile: Profile, reduction: BlockReduction, first: int, parameter_bytes_total: int
) -> Profile:
    """The profile of the whole model from the shortened model's ``profile`` (whose block
    units start at index ``first``): block units repeated with their names, cut bytes and
    stored analytic cost parts mapped as the module docstring says; ``measured_as`` names
    the counted block for every block that was not counted itself. O(units)."""
    kept, length = reduction.kept, reduction.length
    n_short = len(profile.units)
    # Position in the shortened profile of every full unit, and of the cut after it.
    unit_of: list[int] = list(range(first))
    cut_of: list[int] = list(range(first))
    for i in range(length):
        unit_of.append(first + reduction.counted_block(i))
        cut_of.append(first + reduction.counted_cut(i))
    unit_of += list(range(first + kept, n_short))
    cut_of += list(range(first + kept, n_short))
    names = [u.name for u in profile.units[:first]]
    names += [f"{reduction.path}.{i}" for i in range(length)]
    names += [u.name for u in profile.units[first + kept :]]

    units = []
    for k, (name, src) in enumerate(zip(names, unit_of, strict=True)):
        u = dataclasses.replace(profile.units[src], name=name)
        u.shared_parameters = list(u.shared_parameters)
        block = k - first
        # Blocks counted themselves (the same index in the shortened model) keep "".
        copied = 0 <= block < length and reduction.counted_block(block) != block
        u.measured_as = profile.units[src].name if copied else ""
        units.append(u)
    cuts = [profile.cut_bytes[cut_of[k]] for k in range(len(units) - 1)]
    counting = copy.deepcopy(profile.counting)
    if counting is not None:
        parts = counting.units
        # copies, not shared dicts: re-pricing scales every entry in place
        counting.units = [
            {**copy.deepcopy(parts[src]), "name": names[k]} for k, src in enumerate(unit_of)
        ]
        for entry in counting.smaller_sizes:
            parts = entry["units"]
            # one entry per unit, then the loss
            entry["units"] = [copy.deepcopy(parts[src]) for src in unit_of] + parts[n_short:]
    counted = CountedBlocks(
        container=reduction.path,
        blocks=length,
        counted=kept,
        head=reduction.head,
        period=reduction.period,
    )
    out = dataclasses.replace(
        profile,
        units=units,
        cut_bytes=cuts,
        meta=copy.deepcopy(profile.meta),
        counting=counting,
        counted_blocks=counted,
        parameter_bytes_total=parameter_bytes_total,
        total_activation_bytes=sum(u.activation_bytes for u in units),
    )
    return out
