"""The qualitative facts behind benchmarks/mesh_plan.py's figures, on a small Hugging Face Llama
counted on meta for the catalog's H100 (the same code paths as the 70B and 405B figures)."""

from __future__ import annotations

import pytest
import torch
from autopipe.planner import PlanningError, plan
from transformers import LlamaConfig, LlamaForCausalLM

from autopipe.core.cluster import Cluster, Device
from autopipe.core.profile import Profile
from autopipe.core.request import PlanRequest

MESH = dict(gpus_per_node=4, inter_node_bandwidth_bytes_per_s=50e9, checkpoint="auto")


@pytest.fixture(scope="module")
def llama() -> Profile:
    from autopipe.profiler.analytic import profile_analytic

    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=512, use_cache=False,
    )  # fmt: skip
    inputs = {"input_ids": torch.zeros(16, 256, dtype=torch.long)}
    return profile_analytic(lambda: LlamaForCausalLM(config), inputs, "h100")


def _h100(n: int, memory: int | None = None) -> Cluster:
    return Cluster([Device.from_spec("h100", memory_bytes=memory) for _ in range(n)])


def test_a_job_the_pipeline_refuses_gets_a_mesh(llama: Profile) -> None:
    """Figure a in small: below the pipeline's smallest memory, sharding and TP fit."""
    assert llama.tp_degrees == [2, 4] and llama.tp_plan
    with pytest.raises(PlanningError) as refused:
        plan(llama, PlanRequest(cluster=_h100(8, 1), checkpoint="auto", schedule="1f1b"))
    need = refused.value.min_memory_bytes
    assert need is not None
    # 10% less than the pipeline alone needs
    memory = int(need * 0.9)
    with pytest.raises(PlanningError):
        plan(llama, PlanRequest(cluster=_h100(8, memory), checkpoint="auto", schedule="1f1b"))
    out = plan(
        llama,
        PlanRequest(
            cluster=_h100(8, memory),
            schedule="1f1b",
            tensor_parallel="auto",
            data_parallel="auto",
            shard="auto",
            **MESH,
        ),
    )
    assert out.mesh.peak_bytes <= memory / 1.1
    assert out.tensor_parallel > 1 or (out.data_parallel > 1 and out.shard != "none")


def test_the_search_is_no_slower_than_a_fixed_torchtitan_mesh(llama: Profile) -> None:
    """Figure b in small: the chosen mesh beside FSDP 2 x TP 2 x PP 2 priced by the same
    model (the search's space contains it)."""
    fixed = plan(
        llama,
        PlanRequest(
            cluster=_h100(8),
            schedule="1f1b",
            tensor_parallel=2,
            data_parallel=2,
            shard="parameters",
            **MESH,
        ),
    )
    chosen = plan(
        llama,
        PlanRequest(
            cluster=_h100(8),
            schedule="1f1b",
            tensor_parallel="auto",
            data_parallel="auto",
            shard="auto",
            **MESH,
        ),
    )
    assert chosen.iteration_time_s <= fixed.iteration_time_s * (1 + 1e-12)
    rows = chosen.mesh.candidates
    twin = [r for r in rows if (r.pp, r.dp, r.tp, r.shard) == (2, 2, 2, "parameters")]
    assert twin and (twin[0].step_s is None or twin[0].step_s >= chosen.iteration_time_s)
    assert all(8 % r.tp == 0 and 4 % r.tp == 0 for r in rows)  # TP inside a node of 4
