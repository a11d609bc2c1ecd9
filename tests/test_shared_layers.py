"""Models that apply one layer several times (parameters shared across depth).

Hugging Face ALBERT (one ``AlbertLayer`` called 4 times) and a plain-torch loop calling one
``nn.Linear`` block 3 times (``tests/shared_layers_models.py``):

- every call of the shared module is its own unit (``path``, ``path#1``, ``path#2`` ...),
  whose parameters are counted once in the model's totals and named in each call's
  ``shared_parameters``;
- ``autopipe plan`` works measured and analytic (it failed in the B/W split measurement:
  "Trying to backward through the graph a second time"), and a unit that uses a parameter
  more than once is profiled unsplit, with the reason;
- ``autopipe.parallelize`` on 4 CPU "devices", M = 4, planned or cut by hand between every
  two calls: outputs and every parameter's gradient equal the plain model's;
- 2 ranks under torchrun, 2 SGD steps of ``autopipe run`` (GPipe, and zero-bubble schedules
  with a chunk holding two calls, which must run its backward unsplit): losses and trained
  weights equal one process.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import shared_layers_models as models
import torch
import zoo
from autopipe.planner import plan as make_plan
from autopipe.profiler.inputs import call_model
from autopipe.profiler.measure import profile
from autopipe.profiler.objective import default_loss
from autopipe.profiler.options import MeasureOptions
from autopipe.profiler.units import trace_units
from distributed_cases import free_port
from torch.utils import _pytree as pytree

from autopipe import cli
from autopipe.core.plan import Plan, load_plan
from autopipe.core.profile import Profile
from autopipe.core.request import PlanRequest

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(models.__file__).resolve()
RTOL, ATOL = 1e-4, 1e-5
LR = 0.1
GROUP = "albert.encoder.albert_layer_groups.0"
ALBERT_UNITS = [
    "albert.embeddings",
    "albert.encoder.embedding_hidden_mapping_in",
    GROUP,
    f"{GROUP}#1",
    f"{GROUP}#2",
    f"{GROUP}#3",
    "predictions",
]
NEEDS_HF = pytest.mark.skipif(not models.has_transformers(), reason="ALBERT needs transformers")
NAMES = [pytest.param("albert", marks=NEEDS_HF), "looped"]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: Any) -> None:
    monkeypatch.setenv("AUTOPIPE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


def unit_module(name: str) -> str:
    """The module of a unit (autopipe.profiler.units.unit_module, imported when called so
    that the other tests run, and fail, against code without it)."""
    from autopipe.profiler.units import unit_module as module_of

    return module_of(name)


def runs_unsplit(measured: Profile, i: int, j: int) -> bool:
    from autopipe.planner.chunks import runs_unsplit as unsplit

    return unsplit(measured, i, j)


def _quick_profile(name: str, **options: Any) -> Profile:
    model, inputs = models.build(name)
    options_ = MeasureOptions(warmup=0, repeat=1, **options)
    return profile(model, inputs, options_, progress=False, cache=False)


# -- units: one per call --------------------------------------------------------------------


@NEEDS_HF
def test_albert_is_one_unit_per_call_of_its_shared_layer() -> None:
    model, inputs = models.build("albert")
    graph = trace_units(model, inputs)
    assert graph.unit_names == ALBERT_UNITS
    assert graph.unit_kinds[2:6] == ["AlbertLayerGroup"] * 4
    assert {unit_module(u) for u in graph.unit_names[2:6]} == {GROUP}


def test_a_block_called_in_a_loop_is_one_unit_per_call() -> None:
    model, inputs = models.build("looped")
    graph = trace_units(model, inputs)
    assert graph.tracer == "fx"
    assert graph.unit_names == ["inp", "block", "block#1", "block#2", "head"]


@pytest.mark.parametrize("name", NAMES)
def test_shared_parameters_are_counted_once_in_the_totals(name: str) -> None:
    model, _ = models.build(name)
    measured = _quick_profile(name)
    calls = [u for u in measured.units if unit_module(u.name) in (GROUP, "block")]
    assert len(calls) == (4 if name == "albert" else 3)
    shared = {p for p, _ in model.named_parameters() if p.startswith(unit_module(calls[0].name))}
    for u in calls:
        assert set(u.shared_parameters) >= shared
        assert u.parameter_bytes == calls[0].parameter_bytes > 0
    assert measured.parameter_bytes_total == sum(p.numel() * 4 for p in model.parameters())


# -- plan: measured and analytic ------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_plan_measured_and_analytic(name: str, tmp_path: Path) -> None:
    for extra in ([], ["--device", "a100-80gb"]):
        out = tmp_path / "plan.json"
        code = cli.main(
            ["plan", f"{MODELS}:{name}", "--gpus", "2", "--batch-size", "8", "--microbatches"]
            + ["4", "--json", str(out), "-q", "--no-cache", *extra]
        )
        assert code == 0, extra
        plan = load_plan(out)
        assert plan.num_stages == 2 and plan.microbatches == 4
        assert plan.profile_mode == ("analytic" if extra else "measured")
        units = [u for s in plan.stages for u in s.units]
        calls = [u for u in units if "#" in u]
        assert len(calls) == (3 if name == "albert" else 2), units


@NEEDS_HF
def test_a_unit_that_uses_a_parameter_twice_is_profiled_unsplit() -> None:
    """The whole encoder as one unit calls the shared layer 4 times: torch's split weight
    pass fails on it, so its backward is measured whole and priced as B alone."""
    measured = _quick_profile("albert", units=["albert.encoder"])
    encoder = next(u for u in measured.units if u.name == "albert.encoder")
    assert "used 4 times in the unit" in encoder.backward_unsplit
    assert encoder.backward_input_s == encoder.backward_s > 0
    assert encoder.backward_weight_s == 0.0
    others = [u for u in measured.units if u.name != "albert.encoder"]
    assert all(not u.backward_unsplit and u.backward_weight_s > 0 for u in others)
    assert runs_unsplit(measured, 1, 2) and not runs_unsplit(measured, 2, 3)


@NEEDS_HF
def test_a_chunk_holding_two_calls_is_priced_unsplit() -> None:
    measured = _quick_profile("albert")
    assert not runs_unsplit(measured, 1, 3)  # one call of the shared layer
    assert runs_unsplit(measured, 2, 4)  # two calls: the same parameters twice


# -- parallelize: outputs and every gradient -------------------------------------------------


def _cut_between_calls(plan: Plan, name: str) -> Plan:
    """``plan`` (4 stages) with its units re-cut so that every two calls of the shared layer
    lie on different stages."""
    if name == "albert":
        cut = [ALBERT_UNITS[:3], ALBERT_UNITS[3:4], ALBERT_UNITS[4:5], ALBERT_UNITS[5:]]
    else:
        cut = [["inp", "block"], ["block#1"], ["block#2"], ["head"]]
    assert [u for s in plan.stages for u in s.units] == [u for s in cut for u in s]
    return zoo.recut(plan, cut)


def _check_parallelized(name: str, plan: Plan | None) -> Any:
    import autopipe

    model, inputs = models.build(name)
    reference = copy.deepcopy(model)
    pipe = autopipe.parallelize(
        model,
        inputs,
        devices=["cpu"] * 4,
        microbatches=4,
        plan=plan,
        profile_options=MeasureOptions(warmup=0, repeat=1),
        progress=False,
    )
    assert pipe.plan.microbatches == 4 and pipe.num_stages == 4
    out = call_model(pipe, inputs)
    expected = call_model(reference, inputs)
    assert type(out) is type(expected)
    for got, want in zip(pytree.tree_leaves(out), pytree.tree_leaves(expected), strict=True):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    default_loss(out, inputs).backward()
    default_loss(expected, inputs).backward()
    got = dict(model.named_parameters(remove_duplicate=False))
    for pname, p in reference.named_parameters(remove_duplicate=False):
        assert got[pname].grad is not None, f"{pname}: no gradient through the pipeline"
        torch.testing.assert_close(
            got[pname].grad, p.grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=pname: f"{n}: {m}"
        )
    return pipe


@pytest.mark.parametrize("name", NAMES)
def test_parallelize_equals_the_plain_model(name: str) -> None:
    pipe = _check_parallelized(name, None)
    assert any("#" in u for s in pipe.plan.stages for u in s.units)


@pytest.mark.parametrize("name", NAMES)
def test_parallelize_cut_between_calls_equals_the_plain_model(name: str) -> None:
    planned = make_plan(_quick_profile(name), PlanRequest(gpus=4, microbatches=4))
    _check_parallelized(name, _cut_between_calls(planned, name))


# -- torchrun: losses and trained weights ----------------------------------------------------

# (case, schedule, V, the chunks' units by hand, or None for the planner's cut).
RUNS: list[tuple[str, str, int, list[list[str]] | None]] = [
    ("albert-gpipe", "gpipe", 1, [ALBERT_UNITS[:4], ALBERT_UNITS[4:]]),
    # zbv: rank 1 holds chunks 1 and 2; chunk 1 calls the shared layer twice.
    ("albert-zbv", "zbv", 2, [ALBERT_UNITS[:3], ALBERT_UNITS[3:5], ALBERT_UNITS[5:6], ALBERT_UNITS[6:]]),
    ("looped-zb", "interleaved-zb", 2, [["inp"], ["block", "block#1"], ["block#2"], ["head"]]),
    ("looped-1f1b", "1f1b", 1, None),
]  # fmt: skip


def _runs() -> list[tuple[str, str, int, list[list[str]] | None]]:
    return [r for r in RUNS if r[0].startswith("looped") or models.has_transformers()]


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shared_runs")
    profiles: dict[str, Profile] = {}
    for case, schedule, v, cut in _runs():
        name = case.partition("-")[0]
        if name not in profiles:
            profiles[name] = _quick_profile(name)
        plan = make_plan(
            profiles[name],
            PlanRequest(
                gpus=2, microbatches=4, optimizer="sgd", schedule=schedule, virtual_stages=v
            ),
        )
        if cut is not None:
            plan = zoo.recut(plan, cut)
        plan.save(out / f"{case}.plan.json")
    result = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()), str(ROOT / "tests" / "zoo_run.py"),
            "--models", str(ROOT / "tests" / "shared_layers_models.py"), str(out), *(r[0] for r in _runs()),
        ],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def _reference_training(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    return zoo.train_plain(*models.build(name), LR)


@pytest.mark.parametrize("case", [pytest.param(r[0], id=r[0]) for r in RUNS])
def test_torchrun_trains_like_one_process(case: str, torchrun_runs: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    name = case.partition("-")[0]
    if name == "albert" and not models.has_transformers():
        pytest.skip("ALBERT needs transformers")
    for rank in (0, 1):
        assert (torchrun_runs / f"{case}.rank{rank}.rc").read_text() == "0"
    ref_losses, ref_weights = _reference_training(name)
    report = json.loads((torchrun_runs / f"{case}.json").read_text())
    losses = [step["loss"] for step in report["steps"]]
    assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    dcp_to_torch_save(torchrun_runs / f"{case}.ckpt", tmp_path / "weights.pt")
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert set(weights) == set(ref_weights)
    for pname, want in ref_weights.items():
        torch.testing.assert_close(weights[pname], want, rtol=RTOL * LR, atol=ATOL * LR)
