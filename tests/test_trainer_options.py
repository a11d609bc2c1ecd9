"""``Plan.trainer`` (autopipe/core/trainer_options.py): the trainer options a plan was priced
for are one of its instructions (#34), saved in plan files of version 4, read from the report's
request in earlier files, and what the ranks and the emitters act on."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from autopipe.planner import plan as make_plan
from autopipe.planner.emit import _megatron_mesh_args, _megatron_trainer_args
from autopipe.planner.emit_torchtitan import _compiles, _trainer_keys
from planner_instances import random_profile

from autopipe.core.mesh_rules import loss_parallel_problem
from autopipe.core.plan import (
    INSTRUCTION_FIELDS,
    PLAN_VERSION,
    READABLE_PLAN_VERSIONS,
    Plan,
    PlanFormatError,
    load_plan,
)
from autopipe.core.plantext import format_plan
from autopipe.core.request import PlanRequest
from autopipe.core.schedule_rules import preflight
from autopipe.core.trainer_options import TrainerOptions

OPTIONS = TrainerOptions(
    compile=True, precision="fp8", selective_recompute=True, sequence_parallel=False,
    loss_parallel=True, tp_comm_overlap=True, grad_reduce_overlap=True, grad_reduce_fp32=True,
    reshard_after_forward=False,
)  # fmt: skip
"""Every option away from its default."""


@pytest.fixture(scope="module")
def planned() -> Plan:
    return make_plan(
        random_profile(6, 2),
        PlanRequest(gpus=2, microbatches=4, schedule="1f1b", baselines=False, compile=True),
    )


def test_the_planner_copies_the_requests_options(planned: Plan) -> None:
    assert planned.request is not None and planned.request.compile
    assert planned.trainer == TrainerOptions.from_request(planned.request)
    assert planned.trainer.compile and planned.trainer.loss_parallel is False
    assert "trainer" in INSTRUCTION_FIELDS and PLAN_VERSION == 4 in READABLE_PLAN_VERSIONS


def test_the_options_round_trip_through_a_file(planned: Plan, tmp_path: Path) -> None:
    chosen = dataclasses.replace(planned, trainer=OPTIONS)
    path = tmp_path / "plan.json"
    chosen.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 4 and data["trainer"] == dataclasses.asdict(OPTIONS)
    assert "trainer" not in data["report"]  # an instruction, not a prediction
    again = load_plan(path)
    assert again.trainer == OPTIONS and again == chosen
    # the ranks agree on it: it is in the instructions they compare
    assert again.instructions()["trainer"] == OPTIONS.to_dict()


def _version_3(plan: Plan, request: PlanRequest | None) -> dict[str, Any]:
    """``plan`` as a version-3 writer saved it: no ``trainer``, the request in the report."""
    data = plan.to_dict()
    del data["trainer"]
    data["version"] = 3
    data["report"]["request"] = request.to_dict() if request is not None else None
    return data


def test_a_version_3_file_takes_the_options_from_its_request(planned: Plan, tmp_path: Path) -> None:
    path = tmp_path / "v3.json"
    path.write_text(json.dumps(_version_3(planned, PlanRequest(gpus=2, compile=True))))
    loaded = load_plan(path)
    assert loaded.trainer.compile and loaded.trainer == TrainerOptions(
        compile=True, loss_parallel=False
    )
    assert loaded.version == 4  # saved again as version 4, the options written out
    fp8 = PlanRequest(gpus=2, precision="fp8", tp_comm_overlap=True, loss_parallel=True)
    loaded = Plan.from_dict(_version_3(planned, fp8))
    assert loaded.trainer == TrainerOptions.from_request(fp8)
    # no request (a plan built by hand): the defaults, which emit as before they were recorded
    assert Plan.from_dict(_version_3(planned, None)).trainer == TrainerOptions()


def test_a_version_4_file_is_run_by_its_options_not_its_request(planned: Plan) -> None:
    """The request is the report's record of what was asked; the ranks' and the emitters'
    is ``trainer``: a file whose options say eager runs eager, whatever its request says."""
    data = planned.to_dict()
    data["trainer"]["compile"] = False
    eager = Plan.from_dict(data)
    assert eager.request is not None and eager.request.compile and not eager.trainer.compile
    zb = dataclasses.replace(planned, schedule="zbv", virtual_stages=2, microbatches=4)
    assert any(p.startswith("no-compile-with-zero-bubble") for p in preflight(zb))
    zb_eager = dataclasses.replace(zb, trainer=TrainerOptions())
    assert not any(p.startswith("no-compile-with-zero-bubble") for p in preflight(zb_eager))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.update(compile="yes"), "trainer.compile is 'yes'; expected true or false"),
        (lambda t: t.update(precision="fp16"), "trainer.precision is 'fp16'; expected one of"),
        (lambda t: t.update(loss_parallel=1), "trainer.loss_parallel is 1; expected true or"),
    ],
)
def test_a_bad_option_in_a_file_is_refused_in_one_line(
    planned: Plan, edit: Any, message: str
) -> None:
    data = planned.to_dict()
    edit(data["trainer"])
    with pytest.raises(PlanFormatError) as info:
        Plan.from_dict(data)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_trainer_field_must_be_an_object(planned: Plan) -> None:
    data = planned.to_dict()
    data["trainer"] = 5
    with pytest.raises(PlanFormatError, match=r"^trainer is not an object$"):
        Plan.from_dict(data)
    data["trainer"] = {"loss_parallel": None, "from_a_newer_writer": 1}  # both fine
    assert Plan.from_dict(data).trainer == TrainerOptions()


def test_the_emitters_and_rules_read_the_options_not_the_request(planned: Plan) -> None:
    """A plan whose request asked for every option but whose ``trainer`` holds the defaults
    emits and runs as the defaults, and the other way round."""
    everything = PlanRequest(gpus=8, **{k: v for k, v in OPTIONS.to_dict().items()})
    mesh = dataclasses.replace(
        planned, data_parallel=2, tensor_parallel=2, shard="parameters", tp_plan={"*": "colwise"}
    )
    asked = dataclasses.replace(
        mesh, report=dataclasses.replace(mesh.report, request=everything), trainer=TrainerOptions()
    )
    assert _megatron_trainer_args(asked, False) == []
    assert "--sequence-parallel" in _megatron_mesh_args(dataclasses.replace(asked, shard="none"))
    assert _trainer_keys(asked) == {
        "parallelism": {}, "compile": False, "ac_mode": "none", "converters": []
    }  # fmt: skip
    assert loss_parallel_problem(asked) is None and not _compiles(asked)
    chosen = dataclasses.replace(asked, trainer=OPTIONS)
    assert _megatron_trainer_args(chosen, False) == [
        "--fp8-format", "hybrid", "--recompute-granularity", "selective", "--tp-comm-overlap",
        "--overlap-grad-reduce", "--accumulate-allreduce-grads-in-fp32",
    ]  # fmt: skip
    assert "--sequence-parallel" not in _megatron_mesh_args(
        dataclasses.replace(chosen, shard="none")
    )
    assert _trainer_keys(chosen) == {
        "parallelism": {
            "disable_loss_parallel": False, "enable_async_tensor_parallel": True,
            "fsdp_reshard_after_forward": "never",
        },
        "compile": True, "ac_mode": "selective", "converters": ["quantize.linear.float8"],
    }  # fmt: skip
    line = loss_parallel_problem(chosen)
    assert line is not None and line.startswith("loss-parallel:")


def test_the_printed_plan_names_the_options_other_than_the_defaults(planned: Plan) -> None:
    assert "\ntrainer        --compile (what the plan was priced for)\n" in format_plan(planned)
    assert "trainer " not in format_plan(dataclasses.replace(planned, trainer=TrainerOptions()))
    assert OPTIONS.flags() == [
        "--compile", "--precision fp8", "--selective-recompute", "--no-sequence-parallel",
        "--loss-parallel", "--tp-comm-overlap", "--overlap-grad-reduce", "--grad-reduce-fp32",
        "--no-reshard-after-forward",
    ]  # fmt: skip
    # a default request's options print nothing (loss_parallel False is the flag's default)
    assert TrainerOptions.from_request(PlanRequest()).flags() == []
