"""Tensor parallelism leaves no parameter with one TP rank's partial gradient
(runtime/distributed/tp_gradients.py).

Fast: for several Hugging Face families (tests/tp_models.py, tiny configs, random weights),
the one-chunk TP 2 stage is built as DistributedPipeline builds it and split with torch's
styles on a fake two-rank process group (no peer: torch's ``fake`` backend); every parameter
of the chunk is then a DTensor on the TP mesh (split, or replicated by a style whose backward
reduces it) or one the runtime sums over the TP group, and the summed ones are the model's
per-head q/k norms and activation scalars. A family sequence parallelism cannot run is
refused in one line.

Slow: qwen3 and apertus trained 3 SGD steps by torchrun on 2 gloo processes (TP 2, one
stage) equal one process: every parameter's update over the learning rate, rtol 1e-4 / atol
1e-5 (the q/k norms' differ by tens of percent without the sum).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tp_models  # noqa: E402
from distributed_cases import free_port  # noqa: E402

from autopipe.core.plan import Plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
T = 2
BATCH = 4  # M = 2 micro-batches of 2
STEPS, LR = 3, 0.1  # zoo_run.py's learning rate
RTOL, ATOL = 1e-4, 1e-5

SUMMED = {
    "qwen3": r"model\.layers\.\d\.self_attn\.[qk]_norm\.weight",
    "apertus": r"model\.layers\.\d\.(self_attn\.[qk]_norm\.weight|mlp\.act_fn\.alpha_[pn])",
}
"""Per family, the parameters a rank applies to its own heads or features (the rest: none)."""
WHOLE = {"olmo2": r"model\.layers\.\d\.self_attn\.[qk]_norm\.weight"}
"""Per family, the parameters left plain and not summed: applied on every rank to values it
holds whole, so each rank's gradient is the whole one (OLMo-2's q/k norms, over all heads,
after the q/k projections its plan gathers: ``colwise_gather_output``)."""
PER_HEAD = {"cohere_qk_norm": r"model\.layers\.\d\.self_attn\.[qk]_norm\.weight"}
"""Per family, the parameters applied per head of a column-wise split projection and split
with its heads: ``Shard(0)`` on the TP mesh (Cohere's q/k norm weights ``[heads, head_dim]``;
once refused at plan time, before that a shape mismatch in the trace at one rank's shapes)."""
REFUSED: dict[str, str] = {}
"""Families whose TP plan the runtime refuses, and words of the one-line reason (none today: a
head tied to its embedding splits vocab-parallel with it; OLMo-2's post norms and GLM-4's
sandwich norms, after a row-wise module, run ``SequenceParallel`` on the shard)."""


@pytest.fixture(scope="module")
def one_chunk_plan() -> Any:
    """A one-stage plan of the decoder families' six units (embedding, rotary, 2 layers,
    norm, head), M = 2 micro-batches of 2, planned once from qwen3's analytic profile."""
    from autopipe.planner import plan as make_plan
    from autopipe.profiler.analytic import profile_analytic

    from autopipe.core.request import PlanRequest

    profile = profile_analytic(tp_models.qwen3(), tp_models._example(BATCH), "a100-80gb")
    plan = make_plan(profile, PlanRequest(gpus=1, microbatches=2, optimizer="sgd"))
    assert plan.num_stages == 1 and plan.microbatch_size == BATCH // 2
    return plan


@pytest.fixture(scope="module")
def fake_tp_mesh() -> Iterator[Any]:
    """Rank 0 of a fake two-process group (collectives do nothing) and its (1, 1, 2) mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is initialised already")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=T)
    try:
        yield init_device_mesh("cpu", (1, 1, T), mesh_dim_names=("pp", "dp", "tp"))
    finally:
        dist.destroy_process_group()


def family_plan(family: str, plan: Any) -> tuple[Any, dict[str, str]]:
    """(the family's model, ``plan`` with its TP fields: T = 2 and the family's own TP plan
    as the profiler keeps it)."""
    from autopipe.profiler.tensor_parallel import model_tp_plan, runnable_tp_plan

    model = getattr(tp_models, family)()
    tp_plan, _ = runnable_tp_plan(model, model_tp_plan(model))
    return model, dataclasses.replace(plan, tensor_parallel=T, tp_plan=tp_plan)


def tp_chunk(family: str, plan: Any, mesh: Any) -> tuple[torch.nn.Module, list[str]]:
    """The family's one chunk split by TP as DistributedPipeline splits it, and the names of
    its parameters the runtime sums over the TP group."""
    from autopipe.runtime.distributed.mesh import (
        adopt_modules,
        apply_tensor_parallel,
        local_shapes,
        planned_modules,
        retie,
        tied_slots,
    )
    from autopipe.runtime.distributed.pipeline import materialize_chunks, planned_sequence_layout
    from autopipe.runtime.distributed.sequence_parallel import adopt_norms
    from autopipe.runtime.distributed.tp_gradients import (
        partial_gradient_parameters,
        tp_summed_parameters,
    )
    from autopipe.runtime.planned_stages import partition

    model, plan = family_plan(family, plan)
    inputs = tp_models._example(BATCH)
    split = planned_modules(model, plan.tp_plan, T)
    with local_shapes(model, split, T):
        planned = partition(model, inputs, plan, check_parameters=False)
    layout = planned_sequence_layout(planned, model, split, inputs, plan)
    partial = partial_gradient_parameters(planned.graph_module, split, layout)
    adopt_modules(planned.stages[0].module, model, split, layout.per_head)
    adopt_norms(planned.stages[0].module, model, layout.norms)
    (chunk,) = materialize_chunks(planned, plan, [0])
    ties = tied_slots([chunk.body])
    apply_tensor_parallel(chunk.body, split, mesh["tp"], layout)
    retie(ties)
    return chunk.body, tp_summed_parameters(chunk.body, partial)


@pytest.mark.parametrize("family", [*tp_models.FAMILIES, "llama_tied", "cohere_qk_norm"])
def test_every_parameter_of_a_tp_chunk_is_split_or_summed(
    family: str, one_chunk_plan: Any, fake_tp_mesh: Any
) -> None:
    from autopipe.runtime.distributed.mesh import MeshPlanError
    from torch.distributed.tensor import DTensor, Shard

    if family in REFUSED:
        with pytest.raises(MeshPlanError, match=REFUSED[family]) as exc:
            tp_chunk(family, one_chunk_plan, fake_tp_mesh)
        assert "\n" not in str(exc.value)
        return
    body, summed = tp_chunk(family, one_chunk_plan, fake_tp_mesh)
    on_tp, plain = [], []
    for name, p in body.named_parameters():
        if isinstance(p, DTensor):
            assert p.device_mesh.mesh_dim_names == ("tp",), name
            on_tp.append(name)
        else:
            plain.append(name)
    whole = [n for n in plain if family in WHOLE and re.fullmatch(WHOLE[family], n)]
    assert sorted(plain) == sorted(summed + whole), f"{family}: plain and not summed: " + str(
        sorted(set(plain) - set(summed) - set(whole))
    )
    assert len(whole) == (4 if family in WHOLE else 0)  # q_norm, k_norm of 2 layers
    want = SUMMED.get(family)
    assert sorted(n for n in summed if not (want and re.fullmatch(want, n))) == []
    if family == "llama_tied":
        # the head and the embedding split alike, vocab-parallel: one DTensor serves both
        head = body.get_submodule("lm_head").weight
        assert head is body.get_submodule("model.embed_tokens").weight
        assert isinstance(head, DTensor) and head.placements == (Shard(0),)
        assert head.to_local().shape == (tp_models.VOCAB // T, head.shape[1])
    if want:
        assert len(summed) == sum(bool(re.fullmatch(want, n)) for n, _ in body.named_parameters())
        assert summed
    heads = PER_HEAD.get(family)
    split_heads = [n for n in on_tp if heads and re.fullmatch(heads, n)]
    assert len(split_heads) == (4 if heads else 0)  # q_norm, k_norm of 2 layers
    for name in split_heads:
        p = body.get_parameter(name)
        assert p.placements == (Shard(0),), name
        # 4 query heads, 2 key/value heads (GQA) of head_dim 8: each rank its own heads' rows
        rows = 4 if ".q_norm." in name else 2
        assert tuple(p.shape) == (rows, 8) and tuple(p.to_local().shape) == (rows // T, 8)


def test_a_split_modules_buffer_read_by_the_graph_stays_a_plain_tensor(
    one_chunk_plan: Any, fake_tp_mesh: Any
) -> None:
    """Gemma-2's embedding (split vocab-parallel, tied to the head) holds ``embed_scale``,
    which the graph reads after the lookup (``_assert_tensor_metadata``, ``to``, ``mul`` by
    the local activations). ``parallelize_module`` replicates a split module's buffers as
    DTensors, which those ops cannot take (no sharding strategy for the assertion, a DTensor
    times a plain tensor): it stays the plain tensor it was, and the chunk runs."""
    from torch.distributed.tensor import DTensor

    model = tp_models.gemma2()
    want = model.get_submodule("model.embed_tokens").embed_scale.clone()
    body, _ = tp_chunk("gemma2", one_chunk_plan, fake_tp_mesh)
    scale = body.get_submodule("model.embed_tokens").embed_scale
    assert not isinstance(scale, DTensor)
    torch.testing.assert_close(scale, want, rtol=0, atol=0)
    example = tp_models._example(BATCH // 2)
    # fake collectives: the values are not checked, the ops must run
    out = body(example["input_ids"], example["labels"])
    assert out is not None


def test_hugging_face_replicated_with_grad_allreduce_is_kept() -> None:
    """Qwen3's plan names its q/k norms ``replicated_with_grad_allreduce``: the profile keeps
    the entries (the runtime runs them) and does not count them as split."""
    from autopipe.profiler.tensor_parallel import model_tp_plan, runnable_tp_plan

    model = tp_models.qwen3()
    kept, note = runnable_tp_plan(model, model_tp_plan(model))
    assert kept["model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert "q_norm" not in note


def test_rowwise_split_input_takes_its_input_whole() -> None:
    """transformers 5's ``rowwise_split_input`` (Phi-3, GLM, OLMo-2): the input arrives whole
    (after a gathered column-wise output) and the module takes its own share, so a TP rank
    is traced with the module whole, and torch's style is told its input is replicated."""
    from autopipe.runtime.distributed.mesh import local_shapes, planned_modules, tp_style
    from torch.distributed.tensor import Replicate

    model = tp_models.phi3()
    from autopipe.profiler.tensor_parallel import model_tp_plan

    split = planned_modules(model, model_tp_plan(model), T)
    assert split["model.layers.0.mlp.down_proj"] == "rowwise_split_input"
    path = "model.layers.0.mlp.down_proj"
    whole = model.get_submodule(path)
    with local_shapes(model, split, T):
        local = model.get_submodule(path)
        assert isinstance(local, torch.nn.Linear) and isinstance(whole, torch.nn.Linear)
        assert local.weight.shape == whole.weight.shape
    assert tp_style("rowwise_split_input").input_layouts == (Replicate(),)


def labelled(label: str) -> Callable[[str], str]:
    """An ``assert_close`` message: ``label`` before torch's own."""
    return lambda message: f"{label}: {message}"


def _run(out: Path, runs: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(T),
            "--master-port", str(free_port()), str(ROOT / "tests" / "zoo_run.py"),
            "--models", str(ROOT / "tests" / "tp_models.py"), "--steps", str(STEPS),
            str(out), *runs,
        ],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )  # fmt: skip


TRAINED = ("qwen3", "apertus", "glm")


def planned_tp2(family: str) -> Any:
    """The planner's TP 2 plan (one stage, two TP ranks) of ``family``, from its analytic
    profile (the TP plan the profiler kept from the model's own)."""
    from autopipe.planner import plan as make_plan
    from autopipe.profiler.analytic import profile_analytic

    from autopipe.core.request import PlanRequest

    model = getattr(tp_models, family)()
    profile = profile_analytic(model, tp_models._example(BATCH), "a100-80gb")
    request = PlanRequest(
        gpus=T, microbatches=2, optimizer="sgd", tensor_parallel=T, data_parallel=1
    )
    plan = make_plan(profile, request)
    assert (plan.num_stages, plan.tensor_parallel) == (1, T)
    return plan


def test_a_one_stage_plan_has_no_negative_bubble() -> None:
    """GLM's one-stage TP 2 plan had a bubble of -2.2e-16 (busy seconds summed task by task
    passed the end time by an ulp), which loading the plan file refuses."""
    plan = planned_tp2("glm")
    assert plan.bubble_fraction >= 0.0
    assert Plan.from_dict(plan.to_dict()).bubble_fraction == plan.bubble_fraction


@pytest.mark.slow
def test_tp2_trains_like_one_process(tmp_path: Path) -> None:
    from zoo import load_checkpoint, train_plain

    runs = [f"{family}-tp2" for family in TRAINED]
    for family, run in zip(TRAINED, runs, strict=True):
        planned_tp2(family).save(tmp_path / f"{run}.plan.json")
    result = _run(tmp_path, runs)
    assert result.returncode == 0, result.stderr[-4000:]
    for family, run in zip(TRAINED, runs, strict=True):
        for rank in range(T):
            assert (tmp_path / f"{run}.rank{rank}.rc").read_text() == "0", run
        initial = getattr(tp_models, family)().state_dict()
        _, want = train_plain(getattr(tp_models, family)(), tp_models._example(BATCH), LR, STEPS)
        got = load_checkpoint(tmp_path / f"{run}.ckpt", tmp_path)
        for name, start in initial.items():
            if not start.is_floating_point():
                continue
            torch.testing.assert_close(
                (got[name] - start) / LR,
                (want[name] - start) / LR,
                rtol=RTOL,
                atol=ATOL,
                msg=labelled(f"{family} {name}"),
            )
        losses = [s["loss"] for s in json.loads((tmp_path / f"{run}.json").read_text())["steps"]]
        assert len(losses) == STEPS


def test_a_plan_splitting_a_tied_head_is_refused_in_one_line() -> None:
    """A plan (made by hand) that splits a Llama's head tied to its embedding and not the
    embedding: the runtime refuses it in one line before anything is traced; split alike
    (vocab-parallel) the two are planned."""
    from autopipe.runtime.distributed.mesh import MeshPlanError, planned_modules

    model = tp_models.llama_tied()
    plan = {"lm_head": "colwise_gather_output", "model.layers.*.mlp.up_proj": "colwise"}
    with pytest.raises(MeshPlanError, match="tied to model.embed_tokens, and the plan") as exc:
        planned_modules(model, plan, T)
    assert "\n" not in str(exc.value)
    both = planned_modules(model, {**plan, "model.embed_tokens": "embedding_rowwise"}, T)
    assert both["lm_head"] == "colwise_gather_output"
    assert both["model.embed_tokens"] == "embedding_rowwise"


def test_an_embedding_that_scales_its_lookup_runs_the_lookup_alone() -> None:
    """Gemma's embedding multiplies its lookup by a buffer, which the traced graph holds
    after the lookup: the TP call of the embedding runs the lookup alone (a plain
    ``nn.Embedding`` on the same weight), so the stage's output is the model's (this call
    once refused: the buffer was read outside the module's own forward)."""
    import mesh_zoo_models
    from autopipe.profiler.inputs import split_inputs
    from autopipe.runtime.distributed.mesh import (
        adopt_modules,
        call_planned_modules,
        local_shapes,
    )
    from autopipe.runtime.planned_stages import partition

    from autopipe.core.plan import StagePlan

    model = mesh_zoo_models.build("gemma2", "float64")
    inputs = mesh_zoo_models.example_inputs("gemma2", 2)
    units = ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1",
             "model.norm", "lm_head"]  # fmt: skip
    plan = Plan(
        num_stages=1, microbatches=1, microbatch_size=2, batch_size=2,
        stages=[StagePlan(index=0, device="cpu", units=units)],
    )  # fmt: skip
    split = {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}
    with local_shapes(model, split, 1):  # as the runtime re-traces (the head a stand-in)
        planned = partition(model, inputs, plan, check_parameters=False)
    body = planned.stages[0].module
    adopt_modules(body, model, split)
    call_planned_modules(body, split)
    embedding = body.get_submodule("model.embed_tokens")
    assert type(embedding) is torch.nn.Embedding
    assert embedding.weight is model.get_submodule("model.embed_tokens").weight
    with torch.no_grad():
        (got,) = body(*planned.binder(*split_inputs(inputs)))
        want = model(**inputs).logits
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


class _Norm(torch.nn.Module):
    """A stage ending in a norm, whose output (the next stage's column-wise input) crosses
    the cut: ``(norm(x),)`` as a stage graph returns its values."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.norm(x),)


def test_a_sequence_parallel_norms_output_crosses_a_cut_as_a_plain_tensor(
    fake_tp_mesh: Any,
) -> None:
    """A sequence-parallel norm's output is gathered as a DTensor for the split modules it
    feeds; when a cut falls between the two, the stage sends a plain tensor (torch's
    pipelining sends, and runs the backward of, plain tensors: a DTensor there made the
    backward fail with only "Failed to run stage backward:")."""
    from autopipe.runtime.distributed.stages import StageModule
    from autopipe.runtime.split import StageGraph
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleOutput,
        SequenceParallel,
        parallelize_module,
    )
    from torch.fx import symbolic_trace

    body = symbolic_trace(_Norm())
    parallelize_module(body, fake_tp_mesh["tp"], {"norm": SequenceParallel()})
    gather = PrepareModuleOutput(
        output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=False
    )
    parallelize_module(body, fake_tp_mesh["tp"], {"norm": gather})
    x = torch.randn(2, 3, 4, requires_grad=True)  # one rank's 3 positions of 6
    assert isinstance(body(x)[0], DTensor)
    norm_node = next(n.name for n in body.graph.nodes if n.op == "call_module")
    stage = StageModule(StageGraph(0, body, ["x"], [norm_node]))
    (sent,) = stage(x)
    assert not isinstance(sent, DTensor) and sent.shape == (2, 6, 4)
    sent.sum().backward()  # the fake group's gathers do nothing: shapes only
    assert x.grad is not None and x.grad.shape == x.shape


def test_a_stage_errors_root_cause_is_what_the_rank_raises() -> None:
    """torch wraps an error of a stage's backward in "Failed to run stage backward:" and the
    stage's argument shapes; the rank's error is the cause itself."""
    from autopipe.runtime.distributed.pipeline import stage_error_cause

    root = ValueError("the real reason")
    for words in ("[Stage 1] failed to run forward:", "Failed to run stage backward:"):
        try:
            raise RuntimeError(f"\n        {words}\n        Stage output: ...") from root
        except RuntimeError as exc:
            assert stage_error_cause(exc) is root
    assert stage_error_cause(RuntimeError("other")) is None


def test_fsdp2_of_a_chunk_with_two_dtypes_is_refused_up_front() -> None:
    """FSDP2 gathers a chunk's parameters as one group of one dtype: a chunk holding fp32
    and bf16 parameters is refused in one line before any step (it failed at step 1), on
    every rank (each checks every chunk); one dtype per chunk, or no FSDP, runs."""
    from autopipe.runtime.distributed.mesh import MeshPlanError, check_shard_dtypes

    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).bfloat16())
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    for shard in ("parameters", "gradients"):
        with pytest.raises(MeshPlanError, match="2 dtypes") as exc:
            check_shard_dtypes(shard, [plain, mixed])
        assert "chunk 1" in str(exc.value) and "\n" not in str(exc.value)
        check_shard_dtypes(shard, [plain, mixed[1]])
    check_shard_dtypes("optimizer", [mixed])
