"""Which K x D split of 16 A100s trains GPT-6B fastest? The (K, D) model at two link speeds.

Analytic profile of examples/gpt.py:gpt_6b (bf16, batch 64) on the catalog's a100-80gb; for each
K | 16 the planner plans K stages at batch 64 / D, then ``choose_pipeline_data_parallel`` adds
the ring all-reduce of the largest stage's gradients among its D replicas. Prints every split
ranked by modelled throughput. ``python benchmarks/distributed_pp_dp.py`` (a few seconds).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import gpt  # noqa: E402
from autopipe.planner import plan  # noqa: E402
from autopipe.planner.data_parallel import choose_pipeline_data_parallel  # noqa: E402
from autopipe.profiler.analytic import profile_analytic  # noqa: E402
from autopipe.profiler.options import AnalyticOptions  # noqa: E402

from autopipe.core.catalog import get_device  # noqa: E402
from autopipe.core.request import PlanRequest

DEVICES = 16
BATCH = 64
LINKS = {"NVLink-class, 150 GB/s": 150e9, "25 Gb/s Ethernet, 3.1 GB/s": 3.125e9}


def main() -> None:
    with torch.device("meta"):
        model = gpt.gpt_6b()
    profile = profile_analytic(
        model,
        gpt.example_inputs_gpt_6b(BATCH),
        get_device("a100-80gb"),
        AnalyticOptions(dtype="bfloat16"),
        loss_fn=gpt.loss_fn,
    )
    # No memory limit: the figures this benchmark has always printed (it read a profile key,
    # device_memory_bytes, that no profiler writes, so the limit was None).
    memory = None

    def make_plan(stages: int, batch: int):  # noqa: ANN202
        return plan(
            profile,
            PlanRequest(gpus=stages, batch_size=batch, memory_per_device=memory, checkpoint="auto"),
        )

    for link, bandwidth in LINKS.items():
        print(f"{DEVICES} x A100-80GB, GPT 5.75B, batch {BATCH}, all-reduce over {link}")
        for c in choose_pipeline_data_parallel(make_plan, DEVICES, BATCH, bandwidth):
            if c.plan is None:
                print(f"  K={c.stages:2d} D={c.replicas:2d}  infeasible: {c.reason[:90]}")
                continue
            print(
                f"  K={c.stages:2d} D={c.replicas:2d}  M={c.plan.microbatches:3d}  pipeline "
                f"{c.pipeline_s * 1e3:7.1f} ms + all-reduce {c.allreduce_s * 1e3:7.1f} ms  "
                f"-> {c.throughput:6.1f} samples/s"
            )


if __name__ == "__main__":
    main()
