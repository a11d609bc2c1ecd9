"""Issue 33, "refused too late": what the mesh runtime refuses on every rank at start-up is
refused by the planner, with the same reason, in one line (tests/test_mesh_zoo.py's
``refused-start`` cells). Tiny Hugging Face models built from configs (tests/
mesh_zoo_models.py), profiled once each and planned, never run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mesh_zoo_models  # noqa: E402
import mesh_zoo_run  # noqa: E402
from autopipe.planner import RuleViolation  # noqa: E402

import autopipe  # noqa: E402
from autopipe.core import mesh_rules  # noqa: E402
from autopipe.core.plan import replace_plan
from autopipe.core.profile import Profile  # noqa: E402
from autopipe.core.request import PlanRequest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_PROFILES: dict[str, Profile] = {}


def _profile(family: str, sequence: int = mesh_zoo_models.SEQ) -> Profile:
    """The family's measured profile on ``sequence`` positions (once per test session; one
    repeat, nothing cached)."""
    key = f"{family}/{sequence}"
    if key not in _PROFILES:
        import torch
        from autopipe.profiler.options import MeasureOptions

        from autopipe.profiling import profile

        model = mesh_zoo_models.build(family)
        inputs = mesh_zoo_models.example_inputs(family, mesh_zoo_run.BATCH)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, mesh_zoo_models.vocab_of(family), (mesh_zoo_run.BATCH, sequence),
                            generator=g)  # fmt: skip
        inputs = {"input_ids": ids}
        _PROFILES[key] = profile(
            model, inputs, MeasureOptions(warmup=0, repeat=1), progress=False, cache=False
        )
    return _PROFILES[key]


def _request(mesh: str, **fields: Any) -> PlanRequest:
    return PlanRequest(
        gpus=4,
        microbatches=mesh_zoo_run.MICROBATCHES,
        optimizer="sgd",
        baselines=False,
        **{**mesh_zoo_run.MESHES[mesh], **fields},
    )


def test_the_runtime_and_the_planner_apply_one_tied_chunks_rule() -> None:
    import autopipe.planner.mesh as planner_mesh
    from autopipe.runtime.distributed import mesh
    from autopipe.runtime.distributed.mesh import MeshPlanError, check_mesh_plan
    from autopipe.runtime.planned_stages import TiedParameter

    assert mesh.tied_chunks_problem is mesh_rules.tied_chunks_problem
    assert planner_mesh.tied_chunks_problems is mesh_rules.tied_chunks_problems
    profile = _profile("llama_tied")
    plan = autopipe.plan(profile, _request("pp2d2zero1", shard="none"))  # plannable
    fsdp = replace_plan(plan, shard="parameters", profile=profile)  # as a plan file
    tied = [TiedParameter("model.embed_tokens.weight", [0, 1], {})]
    with pytest.raises(MeshPlanError) as exc:
        check_mesh_plan(fsdp, tied)
    expected = mesh_rules.tied_chunks_problem("model.embed_tokens.weight", [0, 1], 1, "parameters")
    assert str(exc.value) == expected
    # the same line from the plan alone (its embedded profile), as emit / explain check it
    assert fsdp.profile is profile
    assert expected in mesh_rules.mesh_problems(fsdp)
    assert mesh_rules.tied_chunks_problem("w", [0, 1], 1, "none") is None  # plain K x D ties
    assert mesh_rules.tied_chunks_problem("w", [1, 1], 2, "parameters") is None  # one chunk
    # the tie summed after the backward composes with TP (DTensor shards placed alike) and
    # with ZeRO-1 (every holder steps the same summed gradient): the mesh zoo trains them
    assert mesh_rules.tied_chunks_problem("w", [0, 1], 2, "none") is None
    assert mesh_rules.tied_chunks_problem("w", [0, 1], 1, "optimizer") is None
    zero1 = replace_plan(plan, shard="optimizer", profile=profile)
    check_mesh_plan(zero1, tied)


def test_a_forced_mesh_with_a_tie_across_chunks_is_refused_at_plan_time() -> None:
    profile = _profile("llama_tied")
    with pytest.raises(RuleViolation) as exc:
        autopipe.plan(profile, _request("pp2d2zero1", shard="parameters"))
    message = str(exc.value)
    assert message.startswith("tied-chunks: parameter 'model.embed_tokens.weight' is tied")
    assert "shard parameters" in message and "\n" not in message
    # ZeRO-1 keeps the tie (tests/test_mesh_zoo.py trains it equal to one process)
    zero1 = autopipe.plan(profile, _request("pp2d2zero1"))
    assert (zero1.num_stages, zero1.data_parallel, zero1.shard) == (2, 2, "optimizer")
    # the sharding left to it, the planner leaves out what ties chunks and says so in its table
    plan = autopipe.plan(profile, _request("pp2d2zero1", shard="auto"))
    assert (plan.num_stages, plan.data_parallel) == (2, 2) and plan.shard in ("none", "optimizer")
    assert plan.mesh is not None
    reasons = [row.reason for row in plan.mesh.candidates]
    assert any(r.startswith("tied-chunks:") for r in reasons), reasons


def test_a_model_sequence_parallelism_cannot_run_plans_t_1_only() -> None:
    """Mixtral on 7 positions, which sequence parallelism cannot split in 2: the runtime's
    own analysis at profile time records why T > 1 cannot run; a forced T is refused in one
    line, an automatic one is 1 with the reason in the notes."""
    profile = _profile("mixtral", 7)
    assert profile.tp_degrees == [2]  # the model itself would split
    assert profile.tp_refusal is not None
    assert "sequence length 7 is not divisible by tensor-parallel degree 2" in profile.tp_refusal
    with pytest.raises(RuleViolation) as exc:
        autopipe.plan(profile, _request("pp2tp2"))
    assert str(exc.value).startswith("tensor-parallel: T=2 cannot run for this model: ")
    assert profile.tp_refusal in str(exc.value)
    plan = autopipe.plan(profile, _request("pp2tp2", tensor_parallel="auto", data_parallel="auto"))
    assert plan.tensor_parallel == 1
    assert f"tensor parallelism not considered: {profile.tp_refusal}" in plan.notes
    # a hand-made plan of T = 2 for it is refused from the plan alone (emit, every rank)
    forced = replace_plan(plan, tensor_parallel=2, tp_plan=dict(profile.tp_plan), profile=profile)
    assert any(p.startswith("tp-runs: ") for p in mesh_rules.mesh_problems(forced))


@pytest.mark.parametrize("family", ["olmo2", "mixtral", "deepseek_v3"])
def test_norms_off_the_column_wise_path_no_longer_refuse_t_2(family: str) -> None:
    """OLMo-2's post norms, Mixtral's norm before its experts, DeepSeek-V3's MLA: sequence
    parallelism runs them (issue 33), so the profile records no refusal and T = 2 plans."""
    profile = _profile(family)
    assert profile.tp_refusal is None
    plan = autopipe.plan(profile, _request("pp2tp2"))
    assert (plan.num_stages, plan.data_parallel, plan.tensor_parallel) == (2, 1, 2)


def test_a_per_head_norm_weight_is_split_with_its_heads_at_t_2() -> None:
    """Cohere's q/k LayerNorm weight is [heads, head_dim], applied per head after the
    column-wise q/k projections: it is split with the heads (Shard(0), each TP rank its own
    heads' rows), so T = 2 is planned (it was refused at plan time, naming the parameter)."""
    from autopipe.runtime.distributed.mesh import per_head_parameters, planned_modules

    profile = _profile("cohere_qk_norm")
    assert profile.tp_refusal is None
    plan = autopipe.plan(profile, _request("pp2tp2"))
    assert (plan.num_stages, plan.data_parallel, plan.tensor_parallel) == (2, 1, 2)
    model = mesh_zoo_models.build("cohere_qk_norm")
    split = planned_modules(model, plan.tp_plan, 2)
    found = per_head_parameters(model, split, 2)
    attention = "model.layers.{}.self_attn.{}"
    # 4 query heads after q_proj; 2 key/value heads (GQA), which k_proj and v_proj both
    # split alike: the first in the module's order is named
    assert found == {
        attention.format(layer, f"{x}_norm.weight"): attention.format(layer, f"{x}_proj")
        for layer in (0, 1)
        for x in "qk"
    }


def test_heads_the_tp_degree_does_not_divide_are_refused_in_one_line() -> None:
    """T = 4 divides the key projection's 16 features but not its 2 key/value heads: a rank
    would hold half of a head's norm weight, so the plan is refused before anything is
    traced, in one line naming the parameter."""
    from autopipe.runtime.distributed.mesh import (
        MeshPlanError,
        local_shapes,
        per_head_parameters,
        planned_modules,
    )

    model = mesh_zoo_models.build("cohere_qk_norm")
    plan = {"model.layers.*.self_attn.k_proj": "colwise"}
    split = planned_modules(model, plan, 4)
    want = (
        "model.layers.0.self_attn.k_norm.weight [2, 8] is per head of the column-wise split "
        "model.layers.0.self_attn.k_proj and its 2 heads do not divide over tensor-parallel "
        "degree 4; re-plan with a --tensor-parallel that divides the heads"
    )
    with pytest.raises(MeshPlanError) as exc:
        per_head_parameters(model, split, 4)
    assert str(exc.value) == want
    with pytest.raises(MeshPlanError, match="k_norm.weight"), local_shapes(model, split, 4):
        pass
    assert model.get_parameter("model.layers.0.self_attn.k_norm.weight").shape == (2, 8)


def test_a_family_that_runs_is_still_planned_at_t_2() -> None:
    profile = _profile("llama")
    assert profile.tp_refusal is None
    plan = autopipe.plan(profile, _request("pp2tp2"))
    assert (plan.num_stages, plan.data_parallel, plan.tensor_parallel) == (2, 1, 2)
    assert not mesh_rules.mesh_problems(plan)


def test_old_profiles_without_the_field_load_and_the_field_round_trips(tmp_path: Path) -> None:
    profile = _profile("mixtral", 7)
    data = profile.to_dict()
    assert Profile.from_dict(data).tp_refusal == profile.tp_refusal
    del data["tp_refusal"]
    assert Profile.from_dict(data).tp_refusal is None


def test_the_cli_refuses_a_forced_t_in_one_line_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "mixtral.json"
    _profile("mixtral", 7).save(path)
    result = subprocess.run(
        [sys.executable, "-m", "autopipe", "plan", str(path), "--gpus", "4",
         "--tensor-parallel", "2", "--data-parallel", "1", "--microbatches", "2"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot run for this model" in lines[0], result.stderr


def test_a_model_counted_on_meta_keeps_its_tp_degrees() -> None:
    """An analytic profile counts the model built on meta with CPU example inputs; the T > 1
    check traced that pair, failed on the device mismatch and recorded it as a refusal: every
    catalog-device plan of examples/hf_llama.py (README's llama2_70b mesh command) lost
    tensor parallelism."""
    from autopipe.profiler.analytic import profile_analytic

    from autopipe.modelfile import load_model_file
    from autopipe.profiling import annotate_tp_refusal

    mf = load_model_file(str(ROOT / "examples" / "hf_llama.py"))
    model, inputs = mf.build(device="meta"), mf.inputs(2)
    assert not inputs["input_ids"].is_meta
    counted = profile_analytic(model, inputs, "h100")
    assert counted.tp_degrees
    assert annotate_tp_refusal(counted, model, inputs).tp_refusal is None
