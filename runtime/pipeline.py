"""Pipeline: an ``nn.Module`` that runs a split fx graph as a GPipe pipeline.

The traced graph is cut into one ``GraphModule`` per stage by ``split.split_graph`` (the
splitter the distributed runtime uses too; ``node_stage`` maps every graph node to its
stage, non-decreasing along data edges). Each stage takes the values live across the cut
before it and returns those live across the cut after it: the next stage's inputs, and also
model inputs or earlier stage outputs needed further on (skip connections, attention masks),
which are passed through the stages in between automatically. Stage ``j`` runs on
``devices[j]`` in the executor (``executor.py``), micro-batch by micro-batch.

Parameters shared by stages on the same device stay one ``Parameter`` (gradients from both
uses sum in ``.grad``); a parameter shared by stages on different devices gets a replica per
device whose gradient is added into the parameter's at the end of backward (``tied.py``).
Cost of the set-up: O(nodes + edges x stages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from autopipe.profiler.inputs import batch_size_of, split_inputs
from autopipe.profiler.objective import LabelItems, LossFn, LossTerm, combine, loss_term
from autopipe.profiler.trace import smallest_batch_size
from autopipe.runtime.activations import ActivationMeter
from autopipe.runtime.batchnorm import begin_minibatch, convert_deferred_batch_norm
from autopipe.runtime.executor import ActionRun, Stage, run_actions, run_pipeline
from autopipe.runtime.microbatch import gather, scatter
from autopipe.runtime.planned_stages import PlannedStages, TiedParameter, tied_parameters
from autopipe.runtime.recorder import Clock, TimelineRecorder
from autopipe.runtime.rng import MicrobatchRNG, draw_base_seed
from autopipe.runtime.split import StageGraph, split_graph, split_units
from autopipe.runtime.tied import TiedReplicas
from autopipe.runtime.torch_devices import as_device
from torch import fx, nn

from autopipe.core.errors import UsageError
from autopipe.core.plan import Plan
from autopipe.core.timeline import Action, Timeline
from autopipe.core.vocabulary import CHECKPOINT_GRANULARITIES

__all__ = ["Pipeline", "ScheduleNeedsStepError"]


class ScheduleNeedsStepError(UsageError, ValueError):
    """A pipeline whose plan runs another schedule than GPipe trained through ``pipe(x)`` and
    ``loss.backward()`` (which can only run fill-drain): use ``Pipeline.step``."""


class Pipeline(nn.Module):
    """A model cut into stages on devices, trained with GPipe micro-batching.

    ``forward(*args, **kwargs)`` takes the model's original inputs and returns its original
    outputs (gathered over micro-batches along dim 0; a loss the model computes itself is
    the mean over micro-batches weighted by the items each averages over, ``label_items``);
    ``loss.backward()`` fills the model's parameter gradients exactly as the unsplit model
    would with the same micro-batches (micro-batch ``i`` draws randomness from seed
    ``base + i``, see ``rng.py``). :meth:`loss` computes the objective micro-batch by
    micro-batch instead, as ``autopipe run`` does (:mod:`autopipe.profiler.objective`).

    ``bind_inputs(args, kwargs) -> list`` gives the placeholder values in order;
    ``unflatten_output`` restores the output structure (identity for fx graphs).
    ``checkpoint``: one bool per stage (True re-materializes every micro-batch of that stage;
    ``autopipe.core.checkpointing.stage_checkpoints`` turns a planner mode into these);
    ``None``: no stage.
    ``deferred_batch_norm``: BatchNorm running statistics move once per mini-batch
    (``batchnorm.DeferredBatchNorm``).
    """

    def __init__(
        self,
        graph_module: fx.GraphModule,
        node_stage: dict[str, int],
        devices: Sequence[torch.device | str | int],
        *,
        microbatches: int = 1,
        checkpoint: Sequence[bool] | None = None,
        bind_inputs: Callable[[tuple[Any, ...], dict[str, Any]], list[Any]] | None = None,
        unflatten_output: Callable[[Any], Any] | None = None,
        plan: Plan | None = None,
        deferred_batch_norm: bool = False,
        static_microbatch_size: int | None = None,
        label_items: LabelItems | None = None,
        schedule: str = "gpipe",
        orders: Sequence[Sequence[Action]] | None = None,
    ) -> None:
        super().__init__()
        graphs = split_graph(graph_module, node_stage, len(devices))
        self._setup(
            graphs,
            devices,
            tied_parameters([g.module for g in graphs], graph_module),
            list(graph_module.modules()),
            microbatches=microbatches,
            checkpoint=checkpoint,
            bind_inputs=bind_inputs,
            unflatten_output=unflatten_output,
            plan=plan,
            deferred_batch_norm=deferred_batch_norm,
            static_microbatch_size=static_microbatch_size,
            smallest_microbatch_size=smallest_batch_size(graph_module),
            label_items=label_items or LabelItems(),
            schedule=schedule,
            orders=orders,
        )
        self._split_units(None, {})

    @classmethod
    def from_partition(
        cls,
        planned: PlannedStages,
        devices: Sequence[torch.device | str | int],
        model: nn.Module,
        *,
        microbatches: int,
        checkpoint: Sequence[bool] | None,
        plan: Plan | None = None,
        deferred_batch_norm: bool = False,
        checkpoint_granularity: Sequence[str] | None = None,
        orders: Sequence[Sequence[Action]] | None = None,
    ) -> Pipeline:
        """A pipeline over the stage graphs of :func:`autopipe.runtime.planned_stages.partition`;
        ``checkpoint_granularity``: per stage, ``"stage"`` or ``"unit"`` (a checkpointed stage
        re-computed one unit at a time; ``StagePlan.checkpoint_granularity``), None: all
        ``"stage"``. ``orders``: the plan's per-rank actions (as :meth:`step` runs them);
        the schedule is the plan's (GPipe without a plan)."""
        if len(planned.stages) != len(devices):
            raise ValueError(
                f"{len(planned.stages)} stages but {len(devices)} devices; give one per stage"
            )
        pipe = cls.__new__(cls)
        nn.Module.__init__(pipe)
        pipe._setup(
            planned.stages,
            devices,
            planned.tied,
            list(model.modules()),
            microbatches=microbatches,
            checkpoint=checkpoint,
            bind_inputs=planned.binder,
            unflatten_output=planned.unflatten_output,
            plan=plan,
            deferred_batch_norm=deferred_batch_norm,
            static_microbatch_size=planned.static_microbatch_size,
            smallest_microbatch_size=smallest_batch_size(planned.graph_module),
            label_items=planned.label_items,
            schedule=plan.schedule if plan is not None else "gpipe",
            orders=orders,
        )
        pipe._split_units(checkpoint_granularity, planned.node_unit)
        return pipe

    def _setup(
        self,
        graphs: list[StageGraph],
        devices: Sequence[torch.device | str | int],
        tied: list[TiedParameter],
        model_modules: list[nn.Module],
        *,
        microbatches: int,
        checkpoint: Sequence[bool] | None,
        bind_inputs: Callable[[tuple[Any, ...], dict[str, Any]], list[Any]] | None,
        unflatten_output: Callable[[Any], Any] | None,
        plan: Plan | None,
        deferred_batch_norm: bool,
        static_microbatch_size: int | None,
        smallest_microbatch_size: int,
        label_items: LabelItems,
        schedule: str,
        orders: Sequence[Sequence[Action]] | None,
    ) -> None:
        num_stages = len(devices)
        if orders is None and schedule != "gpipe":
            raise ValueError(
                f"a {schedule} pipeline needs the plan's per-rank orders (orders="
                "plan.actions); without them it would run GPipe"
            )
        if microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer, got {microbatches}")
        if checkpoint is None:
            checkpoint = [False] * num_stages
        elif isinstance(checkpoint, str):
            raise TypeError(
                f"checkpoint={checkpoint!r}: give one bool per stage (e.g. "
                "autopipe.core.checkpointing.stage_checkpoints(mode, plan flags)); "
                "torchgpipe's per-micro-batch modes are autopipe.GPipe's"
            )
        if len(checkpoint) != num_stages:
            raise ValueError(
                f"got {len(checkpoint)} checkpoint flags for {num_stages} stages; give one per stage"
            )
        self._graphs = graphs
        self.devices = [as_device(d) for d in devices]
        submods = [graph.module for graph in self._graphs]
        if deferred_batch_norm:
            _check_batch_norm_modules(submods)
            for mod in submods:  # parameters and buffers stay shared with the model's BatchNorms
                convert_deferred_batch_norm(mod)
        # A parameter used on several devices keeps one copy per device (tied.py).
        self._tied = TiedReplicas(submods, self.devices, tied, model_modules)
        for mod, dev in zip(submods, self.devices, strict=True):
            mod.to(dev)
        self.stages = nn.ModuleList(submods)
        self.microbatches = microbatches
        self.checkpoint = [bool(c) for c in checkpoint]
        self.plan = plan
        self.static_microbatch_size = static_microbatch_size
        self.smallest_microbatch_size = smallest_microbatch_size
        self.label_items = label_items
        self.schedule = schedule
        """The schedule :meth:`step` runs (``"gpipe"`` unless a plan named another)."""
        self.orders: list[list[Action]] | None = (
            None if orders is None else [list(order) for order in orders]
        )
        """Each rank's actions in order (``Action.stage`` = stage index here), run by
        :meth:`step`; None: GPipe through :meth:`forward` and autograd."""
        self.last_actions: list[list[Action]] | None = None
        """The actions :meth:`step` last ran, per rank, in the order they ran."""
        self.activation_meter: ActivationMeter | None = None
        """Set one (``ActivationMeter(pipe.parameters())``) to count the activation bytes
        :meth:`step` holds for backward (``peak_bytes``)."""
        # The clocks the timeline of each forward is read on (None: CUDA events on a GPU,
        # perf_counter elsewhere); see runtime/recorder.py. The last forward's recorder.
        self.timeline_clocks: dict[str, Clock | None] | None = None
        self.last_recorder: TimelineRecorder | None = None
        self._bind = bind_inputs or _positional_binder(len(self._graphs[0].input_names))
        self._unflatten = unflatten_output or (lambda value: value)
        last = num_stages - 1
        self._stages = [
            # The last stage returns the model's output structure: one value.
            Stage(_single_output(mod) if j == last else mod, dev, list(mod.modules()))
            for j, (mod, dev) in enumerate(zip(submods, self.devices, strict=True))
        ]

    def _split_units(self, granularity: Sequence[str] | None, node_unit: dict[str, int]) -> None:
        """Cut each stage re-materialized per unit into its units' graphs (after the set-up
        moved and tied the parameters: the unit graphs hold the stage's own objects)."""
        self.checkpoint_granularity = list(granularity or ["stage"] * self.num_stages)
        if len(self.checkpoint_granularity) != self.num_stages:
            raise ValueError(
                f"got {len(self.checkpoint_granularity)} checkpoint granularities for "
                f"{self.num_stages} stages; give one per stage"
            )
        last = self.num_stages - 1
        for j, (graph, stage) in enumerate(zip(self._graphs, self._stages, strict=True)):
            if self.checkpoint_granularity[j] not in CHECKPOINT_GRANULARITIES:
                raise ValueError(
                    f"checkpoint granularity {self.checkpoint_granularity[j]!r} of stage {j}; "
                    f"expected one of {', '.join(CHECKPOINT_GRANULARITIES)}"
                )
            if self.checkpoint_granularity[j] != "unit" or not self.checkpoint[j]:
                continue
            units: list[Callable[..., tuple[Any, ...]]] = list(split_units(graph, node_unit))
            if j == last:
                units[-1] = _single_output(units[-1])
            stage.units = units

    @property
    def num_stages(self) -> int:
        return len(self._stages)

    @property
    def last_timeline(self) -> Timeline | None:
        """The last forward's tasks, and its backward's once run, as a ``Timeline`` (None
        before the first forward). Built on each access: read it after ``backward()``."""
        return None if self.last_recorder is None else self.last_recorder.timeline()

    def _checkpoint_fn(self, num_microbatches: int) -> Callable[[int, int], bool]:
        if not (self.training and torch.is_grad_enabled()):
            return lambda i, j: False
        flags = self.checkpoint
        return lambda i, j: flags[j]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        outputs = self._run(args, kwargs)
        pieces = scatter([args, kwargs], len(outputs))  # split as the graph's inputs were
        return gather(outputs, [self.label_items.count(_inputs_of(p)) for p in pieces])

    def loss(self, inputs: Any, target: Any = None, loss_fn: LossFn | None = None) -> Any:
        """Run ``inputs`` (one mini-batch in the example-inputs convention) and return the
        mini-batch loss, computed micro-batch by micro-batch as ``autopipe run`` computes it
        (:meth:`microbatch_loss`). A scalar with its autograd graph: call ``backward()``."""
        return self.microbatch_loss(self.run_microbatches(inputs), inputs, target, loss_fn)

    def run_microbatches(self, inputs: Any) -> list[Any]:
        """Run ``inputs`` (one mini-batch in the example-inputs convention): each
        micro-batch's output in the model's structure, not gathered."""
        args, kwargs = split_inputs(inputs)
        return self._run(args, kwargs)

    def microbatch_loss(
        self,
        outputs: Sequence[Any],
        inputs: Any,
        target: Any = None,
        loss_fn: LossFn | None = None,
    ) -> Any:
        """The mini-batch loss of :meth:`run_microbatches`' ``outputs``:
        ``loss_fn(output_i, target_i)`` (default: the objective of
        :mod:`autopipe.profiler.objective`) on each micro-batch's output and its rows of
        ``target`` (default: ``inputs``), combined as the sum of the sums over the sum of the
        counts. Recorded as the last stage's ``loss`` task of the timeline."""
        targets = scatter([inputs if target is None else target], len(outputs))
        last = self.num_stages - 1
        recorder = self.last_recorder
        assert recorder is not None, "run_microbatches first"
        with recorder.record(last, -1, "loss", self.devices[last]):
            return combine(
                [
                    loss_term(out, piece, loss_fn, self.label_items)
                    for out, (piece,) in zip(outputs, targets, strict=True)
                ]
            )

    def step(self, inputs: Any, target: Any = None, loss_fn: LossFn | None = None) -> Any:
        """Forward and backward of one mini-batch in the schedule's own per-rank order
        (:attr:`orders`, e.g. 1F1B's); returns the mini-batch loss (a detached scalar).

        ``inputs`` in the example-inputs convention; the loss is :meth:`loss`'s (the
        objective of :mod:`autopipe.profiler.objective` per micro-batch, or ``loss_fn``, on
        ``target``, default ``inputs``). Parameter gradients are added into ``.grad``
        exactly as ``loss.backward()`` of the unsplit model would add them. Each
        micro-batch's backward runs when its rank's order says, so a 1F1B rank holds at
        most K - rank micro-batches' activations where GPipe holds M
        (:attr:`activation_meter` counts them). Without :attr:`orders` (a GPipe pipeline
        built without a plan): :meth:`loss` and its backward. The actions run are
        :attr:`last_actions`. With orders, inputs that require grad get no ``.grad`` (the
        step trains parameters)."""
        if self.orders is None:
            loss = self.loss(inputs, target, loss_fn)
            loss.backward()
            return loss.detach()
        args, kwargs = split_inputs(inputs)
        microbatches = self._begin(args, kwargs)
        targets = scatter([inputs if target is None else target], len(microbatches))

        def loss_of(i: int, outputs: tuple[Any, ...]) -> LossTerm:
            (out,) = outputs
            return loss_term(self._unflatten(out), targets[i][0], loss_fn, self.label_items)

        params = [p for p in self.parameters() if p.requires_grad]
        # Each micro-batch backpropagates its term's sum; the mini-batch loss divides by
        # every term's count, known only once the last forward ran: so the gradients of
        # this step are gathered apart from any already in .grad, then divided.
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        meter = self.activation_meter
        assert self.last_recorder is not None
        run: ActionRun = run_actions(
            self._stages,
            microbatches,
            self.orders,
            checkpoint=self._checkpoint_fn(len(microbatches)),
            recorder=self.last_recorder,
            rng=MicrobatchRNG(draw_base_seed()),
            loss_of=loss_of,
            saving=meter.saving if meter is not None else nullcontext,
        )
        self.last_actions = run.executed
        terms: list[LossTerm] = run.terms
        items = sum(t.items for t in terms)
        with torch.no_grad():
            for p, before in zip(params, earlier, strict=True):
                if p.grad is not None:
                    p.grad.mul_(1.0 / items if items > 0 else 0.0)
                    if before is not None:
                        p.grad = before + p.grad
                else:
                    p.grad = before
        return combine([LossTerm(t.total.detach(), t.items) for t in terms])

    def _begin(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[list[Any]]:
        """The micro-batches of a mini-batch, checked, with a new recorder."""
        microbatches = scatter(self._bind(args, kwargs), self.microbatches)
        self._check_microbatch_sizes(microbatches)
        self._tied.refresh()
        if self.training:
            begin_minibatch(list(self.stages), len(microbatches))
        self.last_recorder = TimelineRecorder(
            self.devices,
            num_stages=self.num_stages,
            clocks=self.timeline_clocks,
            schedule=self.schedule,
        )
        return microbatches

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Each micro-batch's output in the model's structure."""
        if self.schedule != "gpipe" and torch.is_grad_enabled():
            raise ScheduleNeedsStepError(
                f"this pipeline's plan runs {self.schedule}, but pipe(x) / pipe.loss(x) with "
                "loss.backward() would run it fill-drain (GPipe): train with "
                "pipe.step(inputs, target, loss_fn), which runs the plan's order (or run "
                "forward under torch.no_grad())"
            )
        microbatches = self._begin(args, kwargs)
        recorder = self.last_recorder
        assert recorder is not None
        outputs = run_pipeline(
            self._stages,
            microbatches,
            checkpoint=self._checkpoint_fn(len(microbatches)),
            recorder=recorder,
            rng=MicrobatchRNG(draw_base_seed()),
        )
        return [self._unflatten(out) for (out,) in outputs]

    def _check_microbatch_sizes(self, microbatches: list[list[Any]]) -> None:
        size = self.static_microbatch_size
        sizes = sorted({batch_size_of(mb) for mb in microbatches})
        if size is None:
            smallest = self.smallest_microbatch_size
            if sizes[0] < smallest:
                raise ValueError(
                    f"this model's graph runs as the model does only at micro-batches of "
                    f"{smallest} samples or more (torch.export took smaller sizes for "
                    f"constants), but this batch splits into micro-batches of "
                    f"{', '.join(map(str, sizes))}; pass a batch that splits into micro-batches "
                    f"of at least {smallest} (e.g. {smallest * self.microbatches} samples)"
                )
            return
        if sizes != [size]:
            raise ValueError(
                f"this model's graph runs only at micro-batches of {size} samples "
                "(traced at that size: torch.export specialised its batch dimension, or forward "
                "hooks recorded one run's chain of children), but this batch splits into "
                f"micro-batches of {', '.join(map(str, sizes))}; pass a batch of "
                f"{size * self.microbatches} samples"
            )


def _inputs_of(piece: list[Any]) -> Any:
    """A micro-batch's ``[args, kwargs]`` as the objective reads inputs (the keywords, where
    the labels are, when there are any)."""
    args, kwargs = piece
    return kwargs if kwargs else args


def _single_output(module: Callable[..., Any]) -> Callable[..., tuple[Any]]:
    def run(*values: Any) -> tuple[Any]:
        return (module(*values),)

    return run


def _positional_binder(count: int) -> Callable[[tuple[Any, ...], dict[str, Any]], list[Any]]:
    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        if kwargs or len(args) != count:
            raise TypeError(
                f"this pipeline takes exactly {count} positional inputs, got {len(args)} and {sorted(kwargs)}"
            )
        return list(args)

    return bind


def _check_batch_norm_modules(stages: Sequence[nn.Module]) -> None:
    """Deferred statistics replace BatchNorm *modules*; a torch.export graph holds BatchNorm
    as an operation on buffers, which would keep moving per micro-batch: refuse it."""
    for mod in stages:
        for node in getattr(mod, "graph", fx.Graph()).nodes:
            name = str(getattr(node.target, "__name__", node.target))
            if node.op == "call_function" and "batch_norm" in name:
                raise ValueError(
                    "deferred_batch_norm=True needs BatchNorm modules in the traced graph, but "
                    "this model was traced by torch.export, which turns them into operations; "
                    "make the model torch.fx-traceable or leave deferred_batch_norm off "
                    "(statistics then move once per micro-batch)"
                )
