"""What a torch user writes by hand, shared by the distributed benchmarks: examples/gpt.py cut
by ``torch.distributed.pipelining.pipeline(split_spec={"blocks.N": BEGINNING})`` and run with a
torch schedule class, on this rank (2 ranks). Not a benchmark itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def torch_split_step(
    rank: int, model: torch.nn.Module, inputs: torch.Tensor, cut: int, microbatches: int,
    schedule_class: type, loss_fn: Callable[[Any, Any], torch.Tensor],
) -> tuple[Callable[[], None], Any]:  # fmt: skip
    """(one training step of this rank, its ``PipelineStage``): ``model`` cut before
    ``blocks.{cut}``, ``inputs`` (the whole batch, also the target) in ``microbatches``."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    split = pipeline(
        model,
        mb_args=(inputs[: inputs.shape[0] // microbatches],),
        split_spec={f"blocks.{cut}": SplitPoint.BEGINNING},
    )
    stage = split.build_stage(rank, torch.device("cpu"))
    schedule = schedule_class(stage, n_microbatches=microbatches, loss_fn=loss_fn)

    def step() -> None:
        stage.submod.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=inputs, losses=[])

    return step, stage
