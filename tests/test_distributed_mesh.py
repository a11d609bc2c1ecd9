"""``autopipe run`` on a (pp, dp, tp) device mesh.

The slow tests run 4 gloo processes on the CPU: PP 2 x TP 2, PP 2 x FSDP2 2 (shard
parameters), TP 2 x FSDP2 2, PP 2 x D 2 and TP 2 x D 2 with ZeRO-1 (shard optimizer, SGD with
momentum so that there is optimizer state to shard; under TP over the DTensors' local
tensors), PP 2 x D 2 with shard gradients (FSDP2 without resharding after forward) and
PP 2 x FSDP2 2 under interleaved 1F1B (two chunks per rank), each on a tiny Hugging Face
Llama (its own ``base_model_tp_plan``) and on examples/gpt.py (its ``tp_plan()``)
(tests/mesh_models.py). Every run trains 3 steps;
its losses, and every parameter of its ``--save`` checkpoint loaded into the plain
(unsharded) model with ``torch.distributed.checkpoint.load``, equal one process training
the plain model on the global batch (rtol 1e-4, atol 1e-5). TP runs with sequence
parallelism (runtime/distributed/sequence_parallel.py): under PP 2 x TP 2 the residual
stream crosses the cut as [b, s / 2, h]; the embedding is split by vocabulary where the
plan says so (Llama's plan; GPT's with ``tok_emb`` added). A tiny Hugging Face Cohere
(parallel attention and MLP) and post-norm blocks (tests/mesh_models.py) run PP 2 x TP 2
too. All seventeen runs share one
torchrun launch (tests/zoo_run.py: each process imports torch and transformers once).
``pytest -s`` prints the largest differences.

The fast tests check the pieces without a process group: the TP plan's modules, the local
shapes a TP rank is traced with, and the refusals (``parallelize`` with T > 1 or sharded
state; a world size that is not pp x dp x tp).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mesh_models  # noqa: E402
from distributed_cases import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("llama", "gpt")
STEPS = 3
LR = 0.1  # zoo_run.py's
RTOL, ATOL = 1e-4, 1e-5
BATCH = 4  # per replica; M = 2 micro-batches of 2
HIDDEN = 32  # both models' (tests/mesh_models.py)
MESHES: dict[str, dict[str, Any]] = {
    "pp2tp2": {"stages": 2, "tensor_parallel": 2},
    "pp2fsdp2": {"stages": 2, "data_parallel": 2, "shard": "parameters"},
    "tp2fsdp2": {"stages": 1, "tensor_parallel": 2, "data_parallel": 2, "shard": "parameters"},
    "pp2d2zero1": {"stages": 2, "data_parallel": 2, "shard": "optimizer"},
    # ZeRO-1 of TP shards: ZeroRedundancyOptimizer over the DTensors' local tensors.
    "tp2d2zero1": {"stages": 1, "tensor_parallel": 2, "data_parallel": 2, "shard": "optimizer"},
    "pp2d2zero2": {"stages": 2, "data_parallel": 2, "shard": "gradients"},
    # torchtitan's pairing: interleaved 1F1B, two chunks per rank, each chunk fully_shard-ed.
    "pp2v2fsdp2": {"stages": 2, "data_parallel": 2, "shard": "parameters", "virtual_stages": 2},
    # GPT's plan with its token embedding split by vocabulary too (Llama's plan has it
    # already): the position embeddings are then the value sharded over the sequence.
    "pp2tp2vocab": {
        "stages": 2,
        "tensor_parallel": 2,
        "tp_extra": {"tok_emb": "embedding_rowwise"},
    },
}
ONLY = {"pp2tp2vocab": ("gpt",)}
"""Meshes run on some of MODELS only."""
RUNS = [(mesh, model) for mesh in MESHES for model in ONLY.get(mesh, MODELS)]
# A Hugging Face Cohere too: attention and MLP in parallel off one norm, so sequence
# parallelism gathers that norm's output once for five column-wise linears.
RUNS.append(("pp2tp2", "cohere"))
# And post-norm blocks (BERT's order): a norm's output feeds the next block's split linear
# and its residual, so it stays a shard there and the linear gathers it itself.
RUNS.append(("pp2tp2", "postnorm"))
OPTIMIZER = {"pp2d2zero1": "sgd-momentum", "tp2d2zero1": "sgd-momentum"}
"""The plan's optimizer where it is not plain SGD."""


def base_plan(model: str, stages: int, optimizer: str = "sgd", virtual_stages: int = 1) -> Any:
    """The planner's K-stage plan for ``model`` (1F1B, or interleaved 1F1B with
    ``virtual_stages`` chunks per rank; 2 micro-batches of 2)."""
    from autopipe.planner import plan as make_plan
    from autopipe.profiler.measure import profile
    from autopipe.profiler.options import MeasureOptions

    from autopipe.core.request import PlanRequest

    built = getattr(mesh_models, model)()
    inputs = getattr(mesh_models, f"example_inputs_{model}")(BATCH)
    measured = profile(built, inputs, MeasureOptions(warmup=0, repeat=1), progress=False)
    schedule = "1f1b" if virtual_stages == 1 else "interleaved-1f1b"
    plan = make_plan(
        measured,
        PlanRequest(
            gpus=stages,
            microbatches=2,
            optimizer=optimizer,
            schedule=schedule,
            virtual_stages=virtual_stages,
        ),
    )
    assert (plan.num_stages, plan.virtual_stages) == (stages, virtual_stages)
    return plan


def mesh_plan(model: str, mesh: str) -> Any:
    """:func:`base_plan` with the mesh fields set (the planner does not choose meshes yet)."""
    spec = dict(MESHES[mesh])
    stages, chunks = spec.pop("stages"), spec.pop("virtual_stages", 1)
    extra = spec.pop("tp_extra", {})
    plan = base_plan(model, stages, OPTIMIZER.get(mesh, "sgd"), chunks)
    if spec.get("tensor_parallel", 1) > 1:
        spec["tp_plan"] = {**mesh_models.tp_plan_of(model), **extra}
    return dataclasses.replace(plan, **spec)


def reference(
    model: str, replicas: int, optimizer: str
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: the plain model trained on the global batch (BATCH x replicas) with
    the plan's optimizer; its losses and its ``state_dict()`` after."""
    from zoo import train_plain

    built = getattr(mesh_models, model)()
    inputs = getattr(mesh_models, f"example_inputs_{model}")(BATCH * replicas)
    momentum = 0.9 if optimizer == "sgd-momentum" else 0.0
    return train_plain(built, inputs, LR, steps=STEPS, momentum=momentum)


SPLIT_AND_REPLICATED = {
    "llama": ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"),
    "gpt": ("blocks.0.attn.qkv.weight", "blocks.0.ln_1.weight"),
    "cohere": ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"),
    "postnorm": ("blocks.0.up.weight", "blocks.0.norm.weight"),
}
EMBEDDING = {"gpt": "tok_emb.weight", "postnorm": "emb.weight"}
"""Per model, its embedding's weight (else Hugging Face's ``model.embed_tokens.weight``)."""
"""Per model: a weight its TP plan splits, and one it leaves whole."""


def saved_pieces(directory: Path, name: str) -> int:
    """How many pieces the ranks wrote of entry ``name`` of a DCP checkpoint."""
    import torch.distributed.checkpoint as dcp

    entry = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata[name]
    return len(entry.chunks)  # type: ignore[union-attr]


def load_plain(model: str, directory: Path) -> nn.Module:
    """The plain model (its own class, unsharded) with the weights of a ``--save``
    checkpoint, read by ``torch.distributed.checkpoint.load`` in this one process; the
    checkpoint must hold exactly the model's own ``state_dict()`` names."""
    import torch.distributed.checkpoint as dcp

    plain = getattr(mesh_models, model)()
    state = plain.state_dict()
    saved = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    assert set(saved) == set(state)
    dcp.load(state, checkpoint_id=str(directory))
    plain.load_state_dict(state)
    return plain


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mesh_runs")
    runs = [f"{model}-{mesh}" for mesh, model in RUNS]
    for run in runs:
        model, mesh = run.split("-")
        mesh_plan(model, mesh).save(out / f"{run}.plan.json")
    result = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
            "--master-port", str(free_port()), str(ROOT / "tests" / "zoo_run.py"),
            "--models", str(ROOT / "tests" / "mesh_models.py"), "--steps", str(STEPS),
            str(out), *runs,
        ],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )  # fmt: skip
    (out / "launch.log").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("mesh", "model"), RUNS)
def test_mesh_trains_like_one_process(mesh: str, model: str, mesh_runs: Path) -> None:
    run = f"{model}-{mesh}"
    for rank in range(4):
        assert (mesh_runs / f"{run}.rank{rank}.rc").read_text() == "0", run
    replicas = MESHES[mesh].get("data_parallel", 1)
    ref_losses, ref_state = reference(model, replicas, OPTIMIZER.get(mesh, "sgd"))
    losses = [s["loss"] for s in json.loads((mesh_runs / f"{run}.json").read_text())["steps"]]
    assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    # What ran: the checkpoint holds each rank's pieces (a TP-split weight in T pieces, an
    # FSDP-sharded parameter in D), and the JSON names the optimizer.
    tp, dp = MESHES[mesh].get("tensor_parallel", 1), replicas
    fsdp = dp if MESHES[mesh].get("shard") in ("parameters", "gradients") else 1
    split, norm = SPLIT_AND_REPLICATED[model]
    assert saved_pieces(mesh_runs / f"{run}.ckpt", split) == tp * fsdp
    assert saved_pieces(mesh_runs / f"{run}.ckpt", norm) == fsdp
    # The plan's vocab-parallel embedding (torch's RowwiseParallel): one piece per TP rank.
    embedding = EMBEDDING.get(model, "model.embed_tokens.weight")
    planned = json.loads((mesh_runs / f"{run}.plan.json").read_text())["tp_plan"] or {}
    vocab_split = "embedding_rowwise" in planned.values()
    want = tp * fsdp if vocab_split else fsdp
    assert saved_pieces(mesh_runs / f"{run}.ckpt", embedding) == want
    record = json.loads((mesh_runs / f"{run}.json").read_text())
    kinds = {"pp2d2zero1": "ZeroRedundancyOptimizer", "tp2d2zero1": "LocalZeroOptimizer"}
    assert record["optimizer"] == kinds.get(mesh, "SGD")
    if tp > 1 and MESHES[mesh]["stages"] > 1:
        # Sequence parallelism: the residual stream crosses the cut as one TP rank's share
        # of the sequence ([b, s / T, h]); the replicated values beside it (a mask, the
        # rotary tables) whole.
        micro = BATCH // 2
        assert [micro, mesh_models.SEQ // tp, HIDDEN] in record["received"], record["received"]
        assert [micro, mesh_models.SEQ, HIDDEN] not in record["received"]
    trained = load_plain(model, mesh_runs / f"{run}.ckpt").state_dict()
    worst = 0.0
    for name, want in ref_state.items():
        torch.testing.assert_close(trained[name], want, rtol=RTOL, atol=ATOL, msg=name)
        worst = max(worst, float((trained[name] - want).abs().max()))
    loss_gap = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    print(f"\n{run}: largest loss difference {loss_gap:.3g}, parameter difference {worst:.3g}")


def test_hf_tp_plan_finds_the_split_linears() -> None:
    from autopipe.runtime.distributed.mesh import planned_modules

    model = mesh_models.llama()
    found = planned_modules(model, mesh_models.tp_plan_of("llama"), 2)
    assert found["model.layers.1.self_attn.q_proj"] == "colwise"
    assert found["model.layers.0.mlp.down_proj"] == "rowwise"
    assert found["lm_head"] == "colwise_gather_output"
    assert found["model.embed_tokens"] == "embedding_rowwise"  # vocab-parallel
    assert len(found) == 2 * 7 + 2  # 7 linears per layer, the head and the embedding


def test_local_shapes_hold_one_ranks_share_and_are_undone() -> None:
    from autopipe.runtime.distributed.mesh import local_shapes, planned_modules

    model = mesh_models.llama()
    planned = planned_modules(model, mesh_models.tp_plan_of("llama"), 2)
    q = model.model.layers[0].self_attn.q_proj
    with local_shapes(model, planned, 2):
        local_q = model.model.layers[0].self_attn.q_proj
        local_o = model.model.layers[0].self_attn.o_proj
        assert local_q.weight.shape == (16, 32)  # colwise: half the output features
        assert local_o.weight.shape == (32, 16)  # rowwise: half the input features
        assert local_q.weight.data_ptr() == q.weight.data_ptr()  # a view, not a copy
        assert model.lm_head.weight.shape == (mesh_models.VOCAB, 32)  # gathered: whole
    assert model.model.layers[0].self_attn.q_proj is q


def test_tp_plan_refusals_are_one_line() -> None:
    from autopipe.runtime.distributed.mesh import MeshPlanError, planned_modules

    model = mesh_models.gpt()
    with pytest.raises(MeshPlanError, match="does not divide") as exc:
        planned_modules(model, {"blocks.*.attn.qkv": "colwise"}, 5)
    assert "\n" not in str(exc.value)
    with pytest.raises(MeshPlanError, match="not supported"):
        planned_modules(model, {"blocks.*.attn.qkv": "sequence_parallel"}, 2)
    with pytest.raises(MeshPlanError, match="splits only nn.Linear"):
        planned_modules(model, {"tok_emb": "colwise"}, 2)
    with pytest.raises(MeshPlanError, match="matches no module"):
        planned_modules(model, {"layers.*.q_proj": "colwise"}, 2)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"tensor_parallel": 2, "tp_plan": {"blocks.*.attn.qkv": "colwise"}}, "tensor-parallel"),
        ({"shard": "optimizer", "data_parallel": 2}, "shard optimizer"),
    ],
)
def test_parallelize_refuses_mesh_plans_in_one_line(fields: dict[str, Any], words: str) -> None:
    from autopipe.runtime.parallelize import PlanNeedsRanksError

    from autopipe.parallelizing import parallelize

    plan = dataclasses.replace(base_plan("gpt", 2), **fields)
    model = mesh_models.gpt()
    with pytest.raises(PlanNeedsRanksError, match=words) as exc:
        parallelize(model, mesh_models.example_inputs_gpt(BATCH), ["cpu", "cpu"], plan=plan)
    assert "\n" not in str(exc.value)


def test_wrong_world_size_is_one_line_on_every_rank(tmp_path: Path) -> None:
    """A PP 2 x TP 2 plan launched on 2 processes: each rank says so in one line, exit 2."""
    plan = mesh_plan("gpt", "pp2tp2")
    plan.save(tmp_path / "plan.json")
    result = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()), "-m", "autopipe", "run",
            f"{ROOT / 'tests' / 'mesh_models.py'}:gpt", "--plan", str(tmp_path / "plan.json"),
            "--steps", "1", "--timeout", "60",
        ],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )  # fmt: skip
    assert result.returncode != 0
    # The ranks' own lines (torchrun's failure summary quotes them again, indented).
    lines = [
        line
        for line in result.stderr.splitlines()
        if line.startswith("[rank") and "pp 2 x dp 1 x tp 2" in line
    ]
    assert sorted(line.split("]")[0] for line in lines) == ["[rank 0", "[rank 1"], result.stderr
    assert all("launch 4" in line for line in lines)


def test_mesh_plans_this_runtime_does_not_run_are_refused_in_one_line() -> None:
    from autopipe.runtime.distributed.mesh import MeshPlanError, check_mesh_plan
    from autopipe.runtime.planned_stages import TiedParameter

    tp = mesh_plan("gpt", "pp2tp2")
    check_mesh_plan(tp)  # runs
    check_mesh_plan(dataclasses.replace(tp, shard="optimizer", data_parallel=2))  # ZeRO-1 of TP too
    refused = [
        (dataclasses.replace(tp, schedule="zbv"), (), "splits the weight pass"),
        # TP-split and plain tied copies are kept equal across chunks; FSDP's are not.
        (
            dataclasses.replace(tp, shard="parameters"),
            [TiedParameter("tok_emb.weight", [0, 1], {})],
            "tied across chunks",
        ),
    ]
    check_mesh_plan(tp, [TiedParameter("tok_emb.weight", [0, 1], {})])
    for plan, tied, words in refused:
        with pytest.raises(MeshPlanError, match=words) as exc:
            check_mesh_plan(plan, tied)
        assert "\n" not in str(exc.value)


@pytest.mark.slow
def test_a_planned_hugging_face_tp_mesh_trains_and_replays(tmp_path: Path) -> None:
    """The join of the three layers on a model autopipe did not write: a Hugging Face Llama
    planned for PP 2 x TP 2 by the planner (its TP plan from the model), trained by torchrun
    on 4 processes at the planned M, traced, and replayed through the planner's simulator.
    The plan splits the embedding by vocabulary (the model's ``embedding_rowwise``), and the
    runtime runs it so (once every rank refused it at start-up)."""
    plan_path, trace = tmp_path / "mesh.json", tmp_path / "trace.json"
    model = str(ROOT / "examples" / "hf_llama.py")
    env = {**os.environ, "PYTHONHASHSEED": "0", "AUTOPIPE_CACHE_DIR": str(tmp_path / "cache")}
    planned = subprocess.run(
        [sys.executable, "-m", "autopipe", "plan", model, "--gpus", "4", "--tensor-parallel", "2",
         "--data-parallel", "1", "--allreduce-bandwidth", "10GB/s", "--json", str(plan_path),
         "-q"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env=env,
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(plan_path.read_text())
    assert (plan["num_stages"], plan["tensor_parallel"]) == (2, 2)
    assert plan["tp_plan"]["model.embed_tokens"] == "embedding_rowwise"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         "--master-port", str(free_port()), "-m", "autopipe", "run", model,
         "--plan", str(plan_path), "--steps", "3", "--timeout", "120", "--trace", str(trace)],
        capture_output=True, text=True, cwd=ROOT, timeout=600, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{plan['microbatches']} micro-batches" in run.stdout + run.stderr
    out = tmp_path / "replay.json"
    replayed = subprocess.run(
        [sys.executable, "-m", "autopipe", "replay", str(trace), "--plan", str(plan_path),
         "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=120, env=env,
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    steps = json.loads(out.read_text())["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["order_differs"] == [] and abs(s["error"]) < 1e-6, s
