"""``autopipe.training``: the TrainRequest's checks, and ``train`` from Python training exactly as
``autopipe run`` does (gloo, 2 ranks under torchrun)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from distributed_cases import free_port, tiny_gpt_files

from autopipe.core.errors import UsageError
from autopipe.core.plan import Plan, load_plan
from autopipe.modelfile import ModelFile, load_model_file
from autopipe.training import TrainRequest, train

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def model_and_plan(tmp_path: Path) -> tuple[ModelFile, Plan]:
    model, plan = tiny_gpt_files(tmp_path, "1f1b")
    return load_model_file(str(model)), load_plan(plan)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("steps", 0, "steps must be a whole number >= 1, got 0"),
        ("steps", True, "steps must be a whole number >= 1, got True"),
        ("steps", 2.5, "steps must be a whole number >= 1, got 2.5"),
        ("lr", 0.0, "lr must be a finite number > 0, got 0.0"),
        ("lr", math.nan, "lr must be a finite number > 0, got nan"),
        ("init", "zeros", "init must be one of replicate, meta, got 'zeros'"),
        ("timeout_s", -1.0, "timeout_s must be > 0 and at most 604800 s, got -1.0"),
        ("timeout_s", 1e10, "timeout_s must be > 0 and at most 604800 s, got 10000000000.0"),
        ("threads", 0, "threads must be a whole number >= 1 or None, got 0"),
        ("save_dir", "", "save_dir is empty; give a path or None"),
        ("trace_path", "", "trace_path is empty; give a path or None"),
        ("model", "examples/gpt.py", "model must be a ModelFile"),
        ("plan", "plan.json", "plan must be a Plan (autopipe.load_plan('PLAN.json'))"),
    ],
)
def test_a_bad_request_is_refused_in_one_line_naming_the_field(
    model_and_plan: tuple[ModelFile, Plan], field: str, value: Any, says: str
) -> None:
    model, plan = model_and_plan
    fields: dict[str, Any] = {"model": model, "plan": plan, field: value}
    with pytest.raises(UsageError) as caught:
        TrainRequest(**fields)
    message = str(caught.value)
    assert message.startswith(f"TrainRequest: {says}") and "\n" not in message


def test_the_defaults_are_autopipe_runs(model_and_plan: tuple[ModelFile, Plan]) -> None:
    from autopipe.cli import build_parser

    model, plan = model_and_plan
    request = TrainRequest(model, plan)
    args = build_parser().parse_args(["run", "M.py", "--plan", "P.json"])
    flags = (args.steps, args.lr, args.init, args.timeout, args.threads, args.allow_nonfinite)
    assert flags == (
        request.steps,
        request.lr,
        request.init,
        request.timeout_s,
        request.threads,
        request.allow_nonfinite,
    )


def test_train_refuses_a_save_dir_before_joining_any_process_group(
    model_and_plan: tuple[ModelFile, Plan], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside torchrun (no RANK), a folder the checkpoint would destroy is what is refused."""
    model, plan = model_and_plan
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match=r"holds 'notes.txt', no part of a checkpoint"):
        train(TrainRequest(model, plan, save_dir=str(tmp_path)))
    with pytest.raises(UsageError, match="start this under torchrun"):
        train(TrainRequest(model, plan))


def test_train_refuses_a_trace_path_it_cannot_write_before_joining_any_process_group(
    model_and_plan: tuple[ModelFile, Plan], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An input overwritten or a folder that takes no new file is refused in one line naming
    the field, outside torchrun (no RANK): so before any process group is joined."""
    model, plan = model_and_plan
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    weights = tmp_path / "weights.pt"
    weights.write_bytes(b"")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.geteuid() == 0:  # root writes anywhere: the folder refuses new files another way
        refuse = PermissionError(13, "Permission denied")
        monkeypatch.setattr("tempfile.mkstemp", lambda **_: (_ for _ in ()).throw(refuse))
    cases = [
        ({"trace_path": str(model.path)}, f"trace_path {model.path} is the input {model.path}; "
         "writing there would destroy it: give another path"),
        ({"trace_path": str(weights), "state_dict_path": str(weights)},
         f"trace_path {weights} is the input {weights}; writing there would destroy it"),
        ({"trace_path": str(tmp_path)}, f"trace_path {tmp_path} is a directory; give a file"),
        ({"trace_path": f"{model.path}/t.json"}, f"{model.path} is a file, not a directory"),
        ({"trace_path": str(locked / "t.json")},
         f"trace_path {locked / 't.json'}: cannot write in {locked} (Permission denied)"),
        ({"save_dir": str(locked / "ckpt")},
         f"--save {locked}: cannot write in {locked} (Permission denied)"),
    ]  # fmt: skip
    for fields, says in cases:
        with pytest.raises(UsageError) as caught:
            train(TrainRequest(model, plan, **fields))
        assert says in str(caught.value) and "\n" not in str(caught.value)
    assert not list(locked.iterdir())


def test_a_trace_inside_the_save_folder_is_refused_before_any_work(
    model_and_plan: tuple[ModelFile, Plan],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The save swaps in a folder that holds only the checkpoint: a trace (or the --json
    report) written into it made the save fail after training had run."""
    from autopipe.cli import main

    model, plan = model_and_plan
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(UsageError) as caught:
        train(TrainRequest(model, plan, save_dir=str(ckpt), trace_path=str(ckpt / "t.json")))
    assert str(caught.value) == (
        f"trace_path {ckpt / 't.json'} is inside save_dir {ckpt}, which holds only the "
        "checkpoint; write it elsewhere"
    )
    plan_file = tmp_path / "plan.json"
    plan.save(plan_file)
    for flag in ("--trace", "--json"):
        args = ["run", str(model.path), "--plan", str(plan_file), "--save", str(ckpt)]
        code = main([*args, flag, str(ckpt / "out.json")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.endswith(
            f"{flag} {ckpt / 'out.json'} is inside --save {ckpt}, which holds only the "
            "checkpoint; write it elsewhere"
        ), err
        assert "\n" not in err
    assert not ckpt.exists()


RANK_SCRIPT = """\
import json, sys
import torch.distributed as dist
import autopipe
from autopipe.cli import main
from autopipe.modelfile import load_model_file
from autopipe.runtime.distributed.process import exit_process, init_distributed

model, plan, out = sys.argv[1:4]
init_distributed(timeout_s=60)  # the caller's group: both runs leave it open
code = main(["run", model, "--plan", plan, "--steps", "3", "--lr", "3e-3", "--timeout", "60",
             "-q", "--json", out + "/cli.json", "--save", out + "/cli.ckpt"])
assert code == 0, code
request = autopipe.TrainRequest(load_model_file(model), autopipe.load_plan(plan), steps=3,
                                lr=3e-3, timeout_s=60, save_dir=out + "/api.ckpt")
result = autopipe.train(request)
if result.reports_loss:
    with open(out + "/api.json", "w") as f:
        json.dump({"losses": [s.loss for s in result.steps], "optimizer": result.optimizer,
                   "received": result.received_shapes, "world_size": result.world_size}, f)
assert dist.is_initialized()
dist.destroy_process_group()
exit_process(0)  # Python's teardown can abort a rank after a clean run
"""


def _weights(checkpoint: Path, tmp_path: Path) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = tmp_path / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, flat)
    weights: dict[str, Any] = torch.load(flat, weights_only=True)
    return weights


def test_train_from_python_trains_exactly_as_autopipe_run(tmp_path: Path) -> None:
    """On the same ranks, ``autopipe.train(TrainRequest(...))`` and ``autopipe run`` with the
    same values give the same losses, optimizer, received shapes and final weights."""
    import torch

    model, plan = tiny_gpt_files(tmp_path, "1f1b")
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    out = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()), str(script), str(model), str(plan), str(tmp_path),
        ],
        capture_output=True, text=True, cwd=ROOT, timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    cli = json.loads((tmp_path / "cli.json").read_text())
    api = json.loads((tmp_path / "api.json").read_text())
    losses = [s["loss"] for s in cli["steps"]]
    assert len(losses) == 3 and losses[-1] < losses[0]  # it trains
    assert api["losses"] == losses
    assert (api["optimizer"], api["received"]) == (cli["optimizer"], cli["received"])
    assert api["world_size"] == 2
    by_cli = _weights(tmp_path / "cli.ckpt", tmp_path)
    by_api = _weights(tmp_path / "api.ckpt", tmp_path)
    initial = load_model_file(str(model)).build().state_dict()
    assert sorted(by_api) == sorted(by_cli) == sorted(initial)
    assert all(torch.equal(by_api[k], by_cli[k]) for k in by_cli)
    assert not all(torch.equal(by_api[k], initial[k]) for k in initial)  # the weights moved
