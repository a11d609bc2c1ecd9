"""Plans handed to other frameworks (issue 15): torch split points, torchtitan TOML, a
Megatron-Core layout, and the refusals where a target cannot say what the plan does.

Emitters are tried on examples/gpt.py, a Hugging Face Llama (when transformers is
installed) and a model with a skip connection across stages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import tomllib
import torch
from autopipe.planner import plan as make_plan
from autopipe.planner.emit import (
    EmitError,
    emit,
    megatron_stage_layers,
    parse_megatron_layout,
    to_megatron,
    to_torch,
    to_torchtitan,
)
from autopipe.profiler.analytic import profile_analytic
from autopipe.profiler.measure import profile
from autopipe.profiler.options import MeasureOptions
from distributed_cases import SkipNet, skipnet_inputs, tiny_gpt
from torch.distributed.pipelining import SplitPoint, pipeline

from autopipe.core.plan import Plan
from autopipe.core.request import PlanRequest

FAST = MeasureOptions(warmup=0, repeat=1, microbatch_sizes=())


def _gpt_plan(stages: int = 4, **request: Any) -> tuple[torch.nn.Module, Any, Plan]:
    model, inputs, loss_fn = tiny_gpt()
    # Counted, not timed: the cut is the same on every run (a timed one may cut the
    # embedding units apart, which Megatron's layout refuses).
    measured = profile_analytic(model, inputs, "a100", loss_fn=loss_fn)
    request.setdefault("microbatches", 4 if request.get("schedule") == "1f1b" else 2)
    return model, inputs, make_plan(measured, PlanRequest(gpus=stages, **request))


def _stage_owners(stage: torch.nn.Module, units: list[str]) -> set[str]:
    """The plan units that own the parameters of a split stage module."""
    owners = set()
    for name, _ in stage.named_parameters():
        owner = [u for u in units if name == u or name.startswith(f"{u}.")]
        assert owner, f"{name} belongs to no unit"
        owners.add(owner[0])
    return owners


def _check_torch_split(
    model: torch.nn.Module,
    mb_args: tuple[Any, ...],
    plan: Plan,
    mb_kwargs: dict[str, Any] | None = None,
) -> None:
    """Fed to torch's own pipeline(), the split gives stages holding the plan's modules."""
    spec = to_torch(plan)
    split = {fqn: SplitPoint.BEGINNING for fqn, where in spec["split_spec"].items()}
    assert set(spec["split_spec"].values()) == {"BEGINNING"}
    pipe = pipeline(model, mb_args=mb_args, mb_kwargs=mb_kwargs, split_spec=split)
    assert pipe.num_stages == len(plan.stages) == len(spec["stage_to_rank"])
    units = [u for s in plan.stages for u in s.units]
    for i, stage in enumerate(plan.stages):
        with_params = {u for u in stage.units if any(True for _ in _params_of(model, u))}
        assert _stage_owners(pipe.get_stage_module(i), units) == with_params


def _params_of(model: torch.nn.Module, unit: str) -> Any:
    try:
        return model.get_submodule(unit).parameters()
    except AttributeError:
        return iter(())


def test_gpt_emits_torch_torchtitan_and_megatron() -> None:
    model, inputs, plan = _gpt_plan()
    spec = to_torch(plan)
    assert spec["schedule"] == "ScheduleGPipe" and spec["n_microbatches"] == 2
    assert spec["stages_per_rank"] == 1 and spec["stage_to_rank"] == [0, 1, 2, 3]
    assert list(spec["split_spec"]) == [s.units[0] for s in plan.stages[1:]]
    _check_torch_split(model, (inputs[:1],), plan)

    toml = tomllib.loads(to_torchtitan(plan))["parallelism"]
    assert toml["pipeline_parallel_degree"] == 4
    assert toml["pipeline_parallel_schedule"] == "GPipe"
    assert toml["pipeline_parallel_microbatch_size"] == plan.microbatch_size
    parts = toml["module_fqns_per_model_part"]
    assert [u for part in parts for u in part] == [n for n, _ in model.named_children()][:3] + [
        f"blocks.{i}" for i in range(4)
    ] + ["ln_f", "head"]  # every top-level module (blocks by block), once, in order

    with pytest.raises(EmitError, match="Megatron-Core has no 'gpipe' schedule"):
        to_megatron(plan)
    out = to_megatron(dataclasses.replace(plan, schedule="1f1b"))  # the same split, 1F1B
    stages = parse_megatron_layout(out["layout"])
    assert stages[0].startswith("E") and stages[-1].endswith("L")
    layers = [sum(u.startswith("blocks.") for u in s.units) for s in plan.stages]
    assert megatron_stage_layers(out["layout"]) == layers  # the round trip
    assert out["args"][out["args"].index("--pipeline-model-parallel-size") + 1] == "4"
    assert out["args"][out["args"].index("--num-layers") + 1] == "4"
    assert "--recompute-granularity" not in out["args"]


def _interleaved(plan: Plan) -> Plan:
    """The 4-chunk plan as 2 ranks x 2 virtual stages, chunk c on rank c mod 2."""
    stages = [dataclasses.replace(s, rank=s.index % 2) for s in plan.stages]
    return dataclasses.replace(
        plan, num_stages=2, virtual_stages=2, schedule="interleaved-1f1b", stages=stages
    )


def test_virtual_stages_in_every_format() -> None:
    model, inputs, plan = _gpt_plan()
    v2 = _interleaved(plan)
    spec = to_torch(v2)
    assert spec["schedule"] == "ScheduleInterleaved1F1B"
    assert spec["stages_per_rank"] == 2 and spec["stage_to_rank"] == [0, 1, 0, 1]
    _check_torch_split(model, (inputs[:1],), v2)  # pipeline() cuts all K x V chunks
    toml = tomllib.loads(to_torchtitan(v2))["parallelism"]
    assert toml["pipeline_parallel_degree"] == 2
    assert toml["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert len(toml["module_fqns_per_model_part"]) == 4
    out = to_megatron(v2)
    assert len(parse_megatron_layout(out["layout"])) == 4
    # The layout's 4 stages on 2 ranks are V = 2; Megatron-LM's validate_args refuses
    # --num-virtual-stages-per-pipeline-rank next to a layout.
    assert "--num-virtual-stages-per-pipeline-rank" not in out["args"]
    assert out["args"][out["args"].index("--pipeline-model-parallel-size") + 1] == "2"
    assert out["args"][out["args"].index("--global-batch-size") + 1] == str(v2.batch_size)
    # M a multiple of K: Megatron's default micro-batch group (K) is the plan's order
    assert "--microbatch-group-size-per-virtual-pipeline-stage" not in out["args"]
    # M = 3 on K = 2: torch runs one round of 3 (Megatron's G = 3; its default G = 2 would
    # leave a last group of 1 < K, which its interleaved schedule refuses)
    three = to_megatron(dataclasses.replace(v2, microbatches=3))["args"]
    flag = three.index("--microbatch-group-size-per-virtual-pipeline-stage")
    assert three[flag + 1] == "3"
    zb = dataclasses.replace(v2, schedule="interleaved-zb")
    assert to_torch(zb)["schedule"] == "ScheduleInterleavedZeroBubble"
    with pytest.raises(EmitError, match="Megatron-Core has no 'interleaved-zb'"):
        to_megatron(zb)


def test_layout_grammar_from_the_documentation() -> None:
    assert parse_megatron_layout("Et*3|(tt|)*2,L") == ["Ettt", "tt", "tt", "L"]
    assert parse_megatron_layout("E||t|L") == ["E", "", "t", "L"]
    assert megatron_stage_layers("Et*3|(tt|)*29,m|L") == [3] + [2] * 29 + [0, 0]
    with pytest.raises(ValueError, match="symbols other than"):
        parse_megatron_layout("Ex|L")


def test_what_a_target_cannot_express_is_refused_in_one_line() -> None:
    model, inputs, plan = _gpt_plan(checkpoint="except_last", schedule="1f1b")
    for emitter in (to_torch, to_torchtitan, to_megatron):
        with pytest.raises(EmitError, match="re-materializes") as info:
            emitter(plan)
        assert "\n" not in str(info.value)
    all_stages = _gpt_plan(checkpoint="always", schedule="1f1b")[2]
    assert tomllib.loads(to_torchtitan(all_stages))["activation_checkpoint"]["mode"] == "full"
    assert "--recompute-granularity" in to_megatron(all_stages)["args"]
    node = dataclasses.replace(plan, granularity="node")
    with pytest.raises(EmitError, match="graph nodes, not modules"):
        emit(dataclasses.replace(node, stages=_gpt_plan()[2].stages), "torch")
    odd = dataclasses.replace(_gpt_plan()[2], schedule="zigzag")
    with pytest.raises(EmitError, match="no schedule for autopipe's 'zigzag'"):
        to_torch(odd)


def test_skip_connection_across_stages() -> None:
    """SkipNet relays a skip and an input through its middle stages; torch's split still
    holds exactly the plan's modules, and Megatron's layout refuses (no layer stack)."""
    torch.manual_seed(0)
    model, inputs = SkipNet(), skipnet_inputs(4)
    measured = profile(model, inputs, FAST, progress=False)
    plan = make_plan(measured, PlanRequest(gpus=3, microbatches=4, schedule="1f1b"))
    _check_torch_split(model, tuple(t[:2] for t in inputs), plan)
    toml = tomllib.loads(to_torchtitan(plan))["parallelism"]
    assert [u for part in toml["module_fqns_per_model_part"] for u in part] == [
        "f1", "f2", "f3", "f4",
    ]  # fmt: skip
    with pytest.raises(EmitError, match="one stack of decoder layers"):
        to_megatron(plan)


def test_hugging_face_llama() -> None:
    pytest.importorskip("transformers")
    import zoo

    model, inputs = zoo.build("llama")
    measured = profile(model, inputs, FAST, progress=False)
    plan = make_plan(measured, PlanRequest(gpus=2, microbatches=2))
    spec = to_torch(plan)
    assert list(spec["split_spec"]) == [plan.stages[1].units[0]]
    _check_torch_split(model, (), plan, {k: v[:4] for k, v in inputs.items()})
    # torchtitan's split keeps top-level modules only: the names are its Llama's.
    parts = tomllib.loads(to_torchtitan(plan))["parallelism"]["module_fqns_per_model_part"]
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    assert [n for p in parts for n in p if n.startswith("layers.")] == [
        f"layers.{i}" for i in range(sum(u.startswith("model.layers.") for u in spec_units(plan)))
    ]
    layout = to_megatron(dataclasses.replace(plan, schedule="1f1b"))["layout"]
    assert megatron_stage_layers(layout) == [
        sum(u.startswith("model.layers.") for u in s.units) for s in plan.stages
    ]


def spec_units(plan: Plan) -> list[str]:
    return [u for s in plan.stages for u in s.units]


def test_torchtitan_runs_the_plans_microbatches() -> None:
    """torchtitan's M is training.local_batch_size // pipeline_parallel_microbatch_size
    (local_batch_size defaults to 8): the TOML sets the batch so that M is the plan's."""
    for m in (2, 4, 8):  # M = 4, 8, 16 on 4 stages
        plan = _gpt_plan(schedule="1f1b", microbatches=m * 2, batch_size=32)[2]
        m *= 2
        toml = tomllib.loads(to_torchtitan(plan))
        local = toml.get("training", {}).get("local_batch_size", 8)
        assert local // toml["parallelism"]["pipeline_parallel_microbatch_size"] == m
        assert "global_batch_size" not in toml["training"]  # one replica: the default
    # Replicas beside PP are FSDP's (torchtitan 0.2.2 refuses DDP there: issue 36).
    replicated = dataclasses.replace(plan, data_parallel=2, shard="parameters")
    toml = tomllib.loads(to_torchtitan(replicated))
    assert toml["training"]["global_batch_size"] == 2 * plan.batch_size
    assert toml["parallelism"]["data_parallel_shard_degree"] == 2


def test_megatron_flags_validate_args_accepts() -> None:
    """Megatron-LM's validate_args: no more than one of --num-layers-per-virtual-pipeline-stage,
    --num-virtual-stages-per-pipeline-rank, --pipeline-model-parallel-layout; its M is
    global batch / (micro batch x data-parallel size), 1 when --global-batch-size is missing."""
    plan = _gpt_plan(stages=2, schedule="1f1b")[2]
    args = to_megatron(plan)["args"]
    exclusive = ["--num-layers-per-virtual-pipeline-stage",
                 "--num-virtual-stages-per-pipeline-rank", "--pipeline-model-parallel-layout"]  # fmt: skip
    assert sum(a in args for a in exclusive) == 1
    flag = dict(zip(args[::2], args[1::2], strict=True))
    global_batch = int(flag.get("--global-batch-size", flag["--micro-batch-size"]))
    assert global_batch // int(flag["--micro-batch-size"]) == plan.microbatches == 4


@pytest.mark.parametrize(
    "edit, rule",
    [
        ({"schedule": "zbv"}, "stages-per-rank"),  # zbv with V = 1
        ({"microbatches": 2, "schedule": "1f1b"}, "microbatches-vs-stages"),  # M < K
        ({"stages_rank": [0, 1, 1, 0]}, "placement"),  # a V-shape for a single-stage plan
    ],
)
def test_emit_refuses_what_preflight_refuses(edit: dict[str, Any], rule: str, tmp_path) -> None:
    import json

    from autopipe.cli import main

    plan = _gpt_plan(schedule="1f1b")[2]  # K = 4, M = 4
    ranks = edit.pop("stages_rank", None)
    if ranks is not None:
        edit["stages"] = [
            dataclasses.replace(s, rank=r) for s, r in zip(plan.stages, ranks, strict=True)
        ]
    bad = dataclasses.replace(plan, **edit)
    for fmt in ("torch", "torchtitan", "megatron"):
        with pytest.raises(EmitError, match=f"pre-flight: {rule}"):
            emit(bad, fmt)
    path, out = tmp_path / "plan.json", tmp_path / "out.txt"
    path.write_text(json.dumps(bad.to_dict()))
    assert main(["emit", str(path), "torch", "-o", str(out), "-q"]) == 2
    assert not out.exists()


def test_emit_refuses_gpipe_with_two_stages_per_rank() -> None:
    v2 = _interleaved(_gpt_plan()[2])
    with pytest.raises(EmitError, match="pre-flight: stages-per-rank"):
        emit(dataclasses.replace(v2, schedule="gpipe"), "torch")


SCHEDULE = ["--schedule", "1f1b"]


def test_cli_emit_and_plan_emit(tmp_path, capsys) -> None:
    from pathlib import Path

    from autopipe.cli import main

    gpt = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
    plan_file, toml_file = tmp_path / "plan.json", tmp_path / "pp.toml"
    assert main(["plan", gpt, "--gpus", "2", "-q", "--json", str(plan_file)] + SCHEDULE) == 0
    assert main(["emit", str(plan_file), "torchtitan", "-o", str(toml_file), "-q"]) == 0
    parts = tomllib.loads(toml_file.read_text())["parallelism"]["module_fqns_per_model_part"]
    assert len(parts) == 2 and parts[0][0] == "tok_emb"
    capsys.readouterr()
    assert main(["emit", str(plan_file), "megatron"]) == 0
    assert '"layout": "E' in capsys.readouterr().out
    # A format that cannot say the plan: one line, exit 2, and nothing written.
    json_out, emit_out = tmp_path / "p2.json", tmp_path / "split.json"
    code = main(
        ["plan", gpt, "--gpus", "2", "-q", "--checkpoint", "always", "--json", str(json_out)]
        + ["--emit", "torch", "--emit-out", str(emit_out)]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--emit torch:" in err
    assert not json_out.exists() and not emit_out.exists()
    assert main(["plan", gpt, "--gpus", "2", "-q", "--emit-out", str(emit_out)]) == 2


def test_every_torchtitan_schedule_name_is_one_torch_resolves() -> None:
    from autopipe.planner.emit import TORCHTITAN_SCHEDULES
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import get_schedule_class

    from autopipe.core.vocabulary import TORCH_CLASSES

    for name, titan in TORCHTITAN_SCHEDULES.items():
        assert get_schedule_class(titan) is getattr(pipelining, TORCH_CLASSES[name])


def test_cli_emit_torchtitan_python(tmp_path, capsys) -> None:
    """The torchtitan 0.3.0 module names its version and BASE; --base is refused elsewhere."""
    import ast
    import json

    from autopipe.cli import main

    plan = _gpt_plan(stages=2, schedule="1f1b")[2]
    path, out = tmp_path / "plan.json", tmp_path / "autopipe_pp.py"
    path.write_text(json.dumps(plan.to_dict()))
    base = "torchtitan.models.llama3.config_registry:llama3_8b"
    assert main(["emit", str(path), "torchtitan-python", "-o", str(out), "-q", "--base", base]) == 0
    module = ast.parse(out.read_text())
    assert "torchtitan 0.3.0" in (ast.get_docstring(module) or "")
    values = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in module.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }
    assert values["BASE"] == base
    assert values["TRAINING"]["local_batch_size"] == plan.batch_size
    assert values["TRAINING"]["disable_cuda_graphs"] is True
    assert values["PARALLELISM"]["pipeline_parallel_degree"] == 2
    capsys.readouterr()
    assert main(["emit", str(path), "torch", "--base", base]) == 2
    assert "--base" in capsys.readouterr().err


def _with_granularity(plan: Plan, granularity: list[str]) -> Plan:
    stages = [
        dataclasses.replace(s, checkpoint=True, checkpoint_granularity=g)
        for s, g in zip(plan.stages, granularity, strict=True)
    ]
    return dataclasses.replace(plan, stages=stages)


def test_per_unit_maps_to_full_and_one_layer_per_recompute() -> None:
    """Per-unit plans are torchtitan's mode "full" and Megatron's one layer per checkpoint,
    exactly; a plan re-materializing stages whole is Megatron's chunk-sized count, a note in
    torchtitan's output, and refused by Megatron where the counts differ."""
    plan = _gpt_plan(2, checkpoint="never", schedule="1f1b")[2]
    layers = [sum(u.startswith("blocks.") for u in s.units) for s in plan.stages]
    unit = _with_granularity(plan, ["unit", "unit"])
    text = to_torchtitan(unit)
    assert tomllib.loads(text)["activation_checkpoint"]["mode"] == "full"
    assert "whole" not in text
    args = to_megatron(unit)["args"]
    assert args[args.index("--recompute-granularity") + 1] == "full"
    assert args[args.index("--recompute-method") + 1] == "uniform"
    assert args[args.index("--recompute-num-layers") + 1] == "1"
    whole = _with_granularity(plan, ["stage", "stage"])
    text = to_torchtitan(whole)
    assert tomllib.loads(text)["activation_checkpoint"]["mode"] == "full"
    assert "re-materializes stages [0, 1] whole" in text
    if len(set(layers)) == 1:
        args = to_megatron(whole)["args"]
        assert args[args.index("--recompute-num-layers") + 1] == str(layers[0])
    mixed = _with_granularity(plan, ["unit", "stage"])
    if layers[1] != 1:
        with pytest.raises(EmitError, match="one count for every chunk") as info:
            to_megatron(mixed)
        assert "\n" not in str(info.value)
    assert "stages [1] whole" in to_torchtitan(mixed)


def test_version_named_torchtitan_formats(tmp_path, capsys) -> None:
    """torchtitan-0.2 is the TOML, torchtitan-0.3 (the current release) the Python module,
    --base included; the older names stay."""
    import json

    from autopipe.cli import main

    plan = _gpt_plan(stages=2, schedule="1f1b")[2]
    assert emit(plan, "torchtitan-0.2") == emit(plan, "torchtitan")
    assert emit(plan, "torchtitan-0.3", "m:f") == emit(plan, "torchtitan-python", "m:f")
    path, out = tmp_path / "plan.json", tmp_path / "autopipe_pp.py"
    path.write_text(json.dumps(plan.to_dict()))
    assert main(["emit", str(path), "torchtitan-0.3", "-o", str(out), "-q", "--base", "m:f"]) == 0
    assert out.read_text() == emit(plan, "torchtitan-python", "m:f")
    capsys.readouterr()
    assert main(["emit", str(path), "torchtitan-0.2", "--base", "m:f"]) == 2
    assert "--base" in capsys.readouterr().err
