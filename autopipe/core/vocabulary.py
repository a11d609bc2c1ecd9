"""The names every layer agrees on: schedules, torch's schedule classes, re-materialization
modes, training-state sharding and the device mesh's dimensions. Torch-free; the one place
each list is spelled out (the CLI's choices, the planner's checks and the emitters read it).
"""

from __future__ import annotations

__all__ = [
    "CHECKPOINT_GRANULARITIES",
    "CHECKPOINT_MODES",
    "DEFAULT_CHECKPOINT",
    "EMBEDDING_TP_STYLES",
    "REPLICATED_TP_STYLES",
    "FRAMEWORK_DEFAULTS",
    "FRAMEWORK_LABELS",
    "LOOP_SCHEDULES",
    "MESH_DIM_NAMES",
    "PLAN_SCHEDULES",
    "PRECISIONS",
    "SEQUENCE_DIM",
    "SHARD_MODES",
    "TP_STYLES",
    "SINGLE_SCHEDULES",
    "SPLIT_BACKWARD_SCHEDULES",
    "TORCH_CLASSES",
    "TORCH_TP_STYLES",
    "V_SHAPE_SCHEDULES",
]

TORCH_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""torch.distributed.pipelining's class for each schedule name."""

PLAN_SCHEDULES = tuple(TORCH_CLASSES)
"""The schedules a plan may name, simplest first (the planner breaks ties in this order)."""

SINGLE_SCHEDULES = ("gpipe", "1f1b")
"""One stage per rank (torch's ``PipelineScheduleSingle``)."""
LOOP_SCHEDULES = ("interleaved-1f1b", "looped-bfs", "interleaved-zb")
"""Chunk ``c`` on rank ``c mod K``, any number of chunks per rank."""
V_SHAPE_SCHEDULES = ("zbv", "dualpipev")
"""Exactly two chunks per rank, ``r`` and ``2K - 1 - r``."""
SPLIT_BACKWARD_SCHEDULES = ("interleaved-zb", "zbv", "dualpipev")
"""Schedules that run backward as separate input-gradient and weight-gradient actions (all
of them for the first two; DualPipeV mixes full backwards and split ones)."""

CHECKPOINT_MODES = ("never", "always", "except_last", "auto")
"""Re-materialization: no stage, every stage, every stage but the last, or chosen per stage."""

PRECISIONS = ("bf16", "fp8")
"""Matmul precisions a plan may be priced for (``PlanRequest.precision``,
``TrainerOptions.precision``, ``autopipe plan --precision``)."""

DEFAULT_CHECKPOINT = "auto"
"""The one default re-materialization mode (``PlanRequest.checkpoint``, ``parallelize``,
``autopipe plan --checkpoint``): a stage re-computes its forward only where its activations
would not fit, so a plan that fits without it is the plan ``never`` would give."""

CHECKPOINT_GRANULARITIES = ("stage", "unit")
"""What a re-materialized stage keeps and re-computes at once: ``stage`` keeps the stage's
input and re-computes the whole stage in its backward; ``unit`` keeps every unit's input and
re-computes one unit at a time (torchtitan's ``[activation_checkpoint] mode = "full"``,
Megatron's ``--recompute-granularity full --recompute-method uniform
--recompute-num-layers 1``). The planner picks, per stage, the one needing less memory."""

SHARD_MODES = ("none", "optimizer", "gradients", "parameters")
"""How the training state is sharded over the D data-parallel replicas: ``none`` (each
replica holds everything; gradients all-reduced), ``optimizer`` (ZeRO-1), ``gradients``
(ZeRO-2) or ``parameters`` (ZeRO-3, FSDP2's ``fully_shard``)."""

TP_STYLES = (
    "colwise",
    "rowwise",
    "colwise_rep",
    "colwise_gather_output",
    "rowwise_rep",
    "rowwise_split_input",
    "embedding_rowwise",
    "replicated_with_grad_allreduce",
)
"""The tensor-parallel plan styles (Hugging Face's words) that ``autopipe run`` maps to torch's
ParallelStyles: ``embedding_rowwise`` (a vocab-parallel embedding) on an ``nn.Embedding``,
``replicated_with_grad_allreduce`` (a module left whole whose gradients are summed over the
TP group) on any module, the others on an ``nn.Linear``; the profiler keeps only these in a
profile's TP plan, so the planner prices what the runtime runs."""
TORCH_TP_STYLES = {
    "colwise": "ColwiseParallel()",
    "rowwise": "RowwiseParallel()",
    "colwise_rep": "ColwiseParallel(output_layouts=Replicate())",
    "colwise_gather_output": "ColwiseParallel(output_layouts=Replicate())",
    "rowwise_rep": "RowwiseParallel(input_layouts=Replicate())",
    "rowwise_split_input": "RowwiseParallel(input_layouts=Replicate())",
    "embedding_rowwise": "RowwiseParallel(input_layouts=Replicate())",
}
"""Each of ``TP_STYLES`` as the ``torch.distributed.tensor.parallel`` style that
``parallelize_module`` takes, written as its constructor call (names from
``torch.distributed.tensor.parallel`` and the placements ``Replicate``, ``Shard`` of
``torch.distributed.tensor``; ``REPLICATED_TP_STYLES`` split nothing and have no style:
``emit`` lists their modules under ``tp_grad_allreduce``): Megatron-style TP without sequence parallelism, which needs
``SequenceParallel`` on the norms between (what ``autopipe run`` adds from the graph)."""
EMBEDDING_TP_STYLES = ("embedding_rowwise",)
"""The styles of ``TP_STYLES`` that split an ``nn.Embedding`` (by vocabulary rows)."""
REPLICATED_TP_STYLES = ("replicated_with_grad_allreduce",)
"""The styles of ``TP_STYLES`` that split nothing: the module stays whole on every TP rank,
which applies it to its own heads or features, so its gradients are summed over the TP
group (the runtime finds such parameters in the graph whether or not the plan names them)."""

SEQUENCE_DIM = 1
"""The dimension of the activations that ``autopipe run``'s sequence parallelism shards over
the TP group: ``[batch, seq, hidden]`` (Hugging Face's and torchtitan's layout), torch's
``Shard(1)`` (runtime/distributed/sequence_parallel.py); the profiler records it as
``UnitProfile.tp_sequence_dim`` so the planner prices the relayout torch's collectives make."""

MESH_DIM_NAMES = ("pp", "dp", "tp")
"""The device mesh's dimensions, outermost first, as torchtitan lays them out: ranks of one
tensor-parallel group are adjacent (inside a node), then the data-parallel dimension, then
the pipeline."""

FRAMEWORK_DEFAULTS = ("torchtitan-even", "megatron-uniform", "deepspeed-parameters")
"""The split each framework makes when the user gives it none (``planner/baselines.py``
computes them, docs/frameworks.md says with which version each rule was read), as
``Plan.baselines`` names them. torch.distributed.pipelining has no default split (pipeline()
without split points gives one stage), so there is no torch entry."""

FRAMEWORK_LABELS = {
    "torchtitan-even": "torchtitan 0.2.2 (even split)",
    "megatron-uniform": "Megatron-Core 0.16 (uniform layers)",
    "deepspeed-parameters": 'DeepSpeed 0.19 ("parameters")',
}
"""Each of ``FRAMEWORK_DEFAULTS`` in the tables' words, with the version read."""
