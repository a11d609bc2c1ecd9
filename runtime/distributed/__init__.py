"""autopipe.runtime.distributed: run a Plan on torch.distributed (torchrun; gloo or NCCL).

Each rank builds only its own chunks (V per rank: the plan's ``K x V`` stages placed as the
schedule places them) and runs them with ``torch.distributed.pipelining`` (one
``PipelineStage`` per chunk and the plan's schedule class: GPipe, 1F1B, interleaved 1F1B,
looped BFS, interleaved zero-bubble, ZBV or DualPipeV); ``W = K x D`` processes give D
data-parallel replicas of every rank. Typical use, on every rank::

    init_distributed()
    pipe = DistributedPipeline(model, plan, example_inputs, loss_fn)
    opt = torch.optim.AdamW(pipe.parameters())
    loss = pipe.step(inputs, target)   # a tensor on last-stage ranks, None elsewhere
    opt.step(); opt.zero_grad()

Names resolve lazily: the torch-free parts (``layout``) import without torch; choosing
``K x D`` is the planner's (``autopipe.planner.data_parallel``).
"""

from __future__ import annotations

from autopipe.core.lazy import lazy_attributes

_LAZY = {
    "DistributedPipeline": "autopipe.runtime.distributed.pipeline",
    "PipelineRankError": "autopipe.runtime.distributed.failures",
    "build_stage": "autopipe.runtime.distributed.pipeline",
    "materialize_stage": "autopipe.runtime.distributed.pipeline",
    "materialize_chunks": "autopipe.runtime.distributed.pipeline",
    "RankChunks": "autopipe.runtime.distributed.pipeline",
    "ScheduleRuleError": "autopipe.runtime.distributed.pipeline",
    "weight_pass_misses": "autopipe.runtime.distributed.zero_bubble",
    "TiedGradients": "autopipe.runtime.distributed.tied",
    "PlanMismatchError": "autopipe.runtime.distributed.agree",
    "check_same_plan": "autopipe.runtime.distributed.agree",
    "init_distributed": "autopipe.runtime.distributed.process",
    "shutdown": "autopipe.runtime.distributed.process",
    "exit_process": "autopipe.runtime.distributed.process",
    "LaunchError": "autopipe.runtime.distributed.process",
    "StageModule": "autopipe.runtime.distributed.stages",
    "StageSplitError": "autopipe.runtime.split",
    "split_stages": "autopipe.runtime.distributed.stages",
    "RankLayout": "autopipe.runtime.distributed.layout",
    "PlanWorldSizeError": "autopipe.runtime.distributed.layout",
    "rank_layout": "autopipe.runtime.distributed.layout",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
