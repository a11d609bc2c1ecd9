"""Pipeline: an ``nn.Module`` that runs a split fx graph as a GPipe pipeline.

The traced graph is cut with ``torch.fx.passes.split_module`` into one submodule per stage
(``node_stage`` maps every graph node to its stage; stages must be non-decreasing along
data edges). The top-level graph of the split says which values each stage consumes; from
it we derive, for every boundary, the values live across it: stage outputs the next stage
needs, and also model inputs or earlier stage outputs needed further on (skip connections,
attention masks), which are passed through the stages in between automatically. Stage
``j`` runs on ``devices[j]`` in the executor (``executor.py``), micro-batch by micro-batch.

Parameters shared by stages on the same device stay one ``Parameter`` (gradients from both
uses sum in ``.grad``); sharing across different devices is refused. Cost of the set-up:
O(nodes + edges x stages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from autopipe.runtime.batchnorm import begin_minibatch, convert_deferred_batch_norm
from autopipe.runtime.devices import as_device
from autopipe.runtime.executor import Stage, run_pipeline
from autopipe.runtime.gpipe import CHECKPOINT_MODES, checkpoint_stop
from autopipe.runtime.microbatch import gather, scatter
from autopipe.runtime.rng import MicrobatchRNG, draw_base_seed
from autopipe.runtime.timeline import Timeline
from torch import fx, nn
from torch.fx.passes.split_module import split_module

__all__ = ["Pipeline", "StageProgram", "split_stages"]


class StageProgram:
    """Stage ``j`` of a split graph as a function of the values live across its input cut.

    ``inputs``/``outputs`` are node names of the split graph's top level; ``nodes`` are the
    top-level nodes the stage evaluates (its ``submod_j`` call and the ``getitem``s on it).
    """

    def __init__(
        self, split: fx.GraphModule, nodes: list[fx.Node], inputs: list[str], outputs: list[str]
    ) -> None:
        self.split = split
        self.nodes = nodes
        self.inputs = inputs
        self.outputs = outputs

    def __call__(self, *values: Any) -> tuple[Any, ...]:
        env = dict(zip(self.inputs, values, strict=True))
        for node in self.nodes:
            args = fx.node.map_arg(node.args, lambda n: env[n.name])
            kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n.name])
            if node.op == "call_module":
                env[node.name] = self.split.get_submodule(str(node.target))(*args, **kwargs)
            elif node.op == "call_function":
                env[node.name] = node.target(*args, **kwargs)  # type: ignore[operator]
            else:  # pragma: no cover - split_module emits only the ops above
                raise RuntimeError(f"unexpected node {node.op} {node.name} in a split graph")
        return tuple(env[name] for name in self.outputs)


def split_stages(
    graph_module: fx.GraphModule, node_stage: dict[str, int], num_stages: int
) -> tuple[fx.GraphModule, list[StageProgram], list[str], fx.Node]:
    """Split ``graph_module`` into ``num_stages`` stages.

    Returns the split module, one program per stage, the placeholder names (stage 0's
    inputs come first among them) and the output node of the split graph.
    ``node_stage`` must give every call node a stage in ``[0, num_stages)``.
    """
    for node in graph_module.graph.nodes:
        if node.op not in ("placeholder", "get_attr", "output") and node.name not in node_stage:
            raise ValueError(
                f"graph node {node.name!r} has no stage; node_stage must cover every call node"
            )
    used = {
        node_stage[n.name]
        for n in graph_module.graph.nodes
        if n.op not in ("placeholder", "get_attr", "output")
    }
    if used != set(range(num_stages)):
        missing = sorted(set(range(num_stages)) - used)
        raise ValueError(
            f"stages {missing} have no graph nodes; every stage needs at least one operation"
        )
    split = split_module(
        graph_module, graph_module, lambda n: node_stage[n.name], keep_original_order=True
    )

    top = list(split.graph.nodes)
    placeholders = [n.name for n in top if n.op == "placeholder"]
    output = next(n for n in top if n.op == "output")
    stage_of: dict[str, int] = {name: -1 for name in placeholders}
    for node in top:
        if node.op == "call_module" and str(node.target).startswith("submod_"):
            stage_of[node.name] = int(str(node.target).split("_")[1])
        elif node.op == "call_function":
            deps = [stage_of[a.name] for a in node.all_input_nodes]
            stage_of[node.name] = max(deps, default=0)
        elif node.op not in ("placeholder", "output"):
            raise RuntimeError(
                f"unexpected top-level {node.op} node {node.name} in the split graph"
            )
    order = {n.name: k for k, n in enumerate(top)}
    last_use: dict[str, int] = {}
    for node in top:
        consumer = num_stages if node.op == "output" else stage_of[node.name]
        for arg in node.all_input_nodes:
            last_use[arg.name] = max(last_use.get(arg.name, -1), consumer)

    programs = []
    for j in range(num_stages):
        nodes = [
            n for n in top if n.op != "placeholder" and n.op != "output" and stage_of[n.name] == j
        ]
        ins = [
            name
            for name in order
            if stage_of.get(name, num_stages) < j and last_use.get(name, -1) >= j
        ]
        outs = [
            name
            for name in order
            if stage_of.get(name, num_stages) <= j and last_use.get(name, -1) > j
        ]
        programs.append(StageProgram(split, nodes, ins, outs))
    return split, programs, placeholders, output


class Pipeline(nn.Module):
    """A model cut into stages on devices, trained with GPipe micro-batching.

    ``forward(*args, **kwargs)`` takes the model's original inputs and returns its original
    outputs (gathered over micro-batches along dim 0); ``loss.backward()`` fills the model's
    parameter gradients exactly as the unsplit model would with the same micro-batches
    (micro-batch ``i`` draws randomness from seed ``base + i``, see ``rng.py``).

    ``bind_inputs(args, kwargs) -> list`` gives the placeholder values in order;
    ``unflatten_output`` restores the output structure (identity for fx graphs).
    ``checkpoint``: one of ``"always"``, ``"except_last"``, ``"never"`` for every stage, or one
    bool per stage (True re-materializes every micro-batch of that stage).
    ``deferred_batch_norm``: BatchNorm running statistics move once per mini-batch
    (``batchnorm.DeferredBatchNorm``).
    """

    def __init__(
        self,
        graph_module: fx.GraphModule,
        node_stage: dict[str, int],
        devices: Sequence[torch.device | str | int],
        *,
        chunks: int = 1,
        checkpoint: str | Sequence[bool] = "except_last",
        bind_inputs: Callable[[tuple[Any, ...], dict[str, Any]], list[Any]] | None = None,
        unflatten_output: Callable[[Any], Any] | None = None,
        plan: Any = None,
        deferred_batch_norm: bool = False,
    ) -> None:
        super().__init__()
        num_stages = len(devices)
        if chunks < 1:
            raise ValueError(f"chunks must be a positive integer, got {chunks}")
        if isinstance(checkpoint, str):
            if checkpoint not in CHECKPOINT_MODES:
                raise ValueError(
                    f"checkpoint is not one of {', '.join(map(repr, CHECKPOINT_MODES))}: got {checkpoint!r}"
                )
        elif len(checkpoint) != num_stages:
            raise ValueError(
                f"got {len(checkpoint)} checkpoint flags for {num_stages} stages; give one per stage"
            )
        split, programs, placeholders, output = split_stages(graph_module, node_stage, num_stages)
        self.devices = [as_device(d) for d in devices]
        submods = [split.get_submodule(f"submod_{j}") for j in range(num_stages)]
        if deferred_batch_norm:
            for mod in submods:  # parameters and buffers stay shared with the model's BatchNorms
                convert_deferred_batch_norm(mod)
        _check_shared_parameters(submods, self.devices)
        for mod, dev in zip(submods, self.devices, strict=True):
            mod.to(dev)
        self.stages = nn.ModuleList(submods)
        self.chunks = chunks
        self.checkpoint = (
            checkpoint if isinstance(checkpoint, str) else [bool(c) for c in checkpoint]
        )
        self.plan = plan
        self.last_timeline: Timeline | None = None
        self._split = split
        self._programs = programs
        self._placeholders = placeholders
        self._output = output
        self._bind = bind_inputs or _positional_binder(len(placeholders))
        self._unflatten = unflatten_output or (lambda value: value)
        self._stages = [
            Stage(program, dev, list(mod.modules()))
            for program, mod, dev in zip(programs, submods, self.devices, strict=True)
        ]

    @property
    def num_stages(self) -> int:
        return len(self._stages)

    def _checkpoint_fn(self, num_microbatches: int) -> Callable[[int, int], bool]:
        if not (self.training and torch.is_grad_enabled()):
            return lambda i, j: False
        if isinstance(self.checkpoint, str):
            stop = checkpoint_stop(self.checkpoint, num_microbatches)
            return lambda i, j: i < stop
        flags = self.checkpoint
        return lambda i, j: flags[j]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = self._bind(args, kwargs)
        microbatches = scatter(flat, self.chunks)
        if self.training:
            begin_minibatch(list(self.stages), len(microbatches))
        # Stage 0's program reads its inputs by name; model inputs not needed by stage 0 are
        # still in its input list when a later stage needs them (they pass through).
        first = self._programs[0].inputs
        index = {name: k for k, name in enumerate(self._placeholders)}
        stage_inputs = [[mb[index[name]] for name in first] for mb in microbatches]
        self.last_timeline = timeline = Timeline()
        outputs = run_pipeline(
            self._stages,
            stage_inputs,
            checkpoint=self._checkpoint_fn(len(microbatches)),
            timeline=timeline,
            rng=MicrobatchRNG(draw_base_seed()),
        )
        last = self._programs[-1].outputs
        per_mb = []
        for values in outputs:
            env = dict(zip(last, values, strict=True))
            result = fx.node.map_arg(self._output.args[0], lambda n, env=env: env[n.name])
            per_mb.append(self._unflatten(result))
        return gather(per_mb)


def _positional_binder(count: int) -> Callable[[tuple[Any, ...], dict[str, Any]], list[Any]]:
    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        if kwargs or len(args) != count:
            raise TypeError(
                f"this pipeline takes exactly {count} positional inputs, got {len(args)} and {sorted(kwargs)}"
            )
        return list(args)

    return bind


def _check_shared_parameters(stages: list[nn.Module], devices: list[torch.device]) -> None:
    """Refuse a parameter used by stages on different devices: it cannot live on both."""
    owner: dict[int, tuple[int, str]] = {}
    for j, mod in enumerate(stages):
        for name, p in mod.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(p), (j, name))
            if devices[first[0]] != devices[j]:
                raise ValueError(
                    f"parameter {first[1]!r} is shared by stage {first[0]} ({devices[first[0]]}) and "
                    f"stage {j} ({devices[j]}); tied weights must be on one device: place those "
                    "stages on the same device or untie the weights"
                )
