"""The model zoo from plan to training: third-party models built from tiny configs.

For every family of ``tests/zoo.py`` (Hugging Face Llama, Qwen2 and Mistral with a padding
mask, Mixtral, GPT-2 with its tied head, T5 with its shared embedding, ViT, a causal LM
called with ``labels=``; torchvision resnet50 and vit_b_16 where torchvision works):

1. ``autopipe plan`` succeeds measured and analytic (``--device a100-80gb``);
2. ``autopipe.parallelize(model, inputs, devices=["cpu"] * 4, microbatches=4)``: outputs and
   every parameter's gradient equal the plain model's (rtol 1e-4, atol 1e-5);
3. a 2-rank plan at M = 4 trained 2 steps under torchrun with ``autopipe run``: the losses
   and the trained weights equal one process training the plain model (SGD, so the weights
   after 2 steps differ by lr x the summed gradient difference). Each family runs another
   of torch.distributed.pipelining's seven schedules (``zoo.SCHEDULE_OF``), so all of them,
   interleaved, looped, zero-bubble and V-shaped with 2 chunks per rank, train third-party
   models.

Step 3 runs every family in one torchrun launch: ``tests/zoo_run.py`` calls the CLI's own
entry point, ``autopipe run``, once per family in the same processes, so torch and
transformers are imported once (the plain ``torchrun -m autopipe run`` command line is
tested in test_distributed_cli.py). The plans of step 3 come from step 1's measured
profiles.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import zoo  # noqa: E402
from autopipe.planner import plan as make_plan  # noqa: E402
from autopipe.profiler.inputs import call_model  # noqa: E402
from autopipe.profiler.measure import profile  # noqa: E402
from autopipe.profiler.objective import default_loss  # noqa: E402
from autopipe.profiler.options import MeasureOptions  # noqa: E402
from autopipe.profiler.trace import TraceError  # noqa: E402
from autopipe.profiler.units import trace_units, unit_module  # noqa: E402
from distributed_cases import free_port  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

from autopipe import cli  # noqa: E402
from autopipe.core.plan import load_plan  # noqa: E402
from autopipe.core.request import PlanRequest

ROOT = Path(__file__).resolve().parents[1]
ZOO = Path(zoo.__file__).resolve()
RTOL, ATOL = 1e-4, 1e-5
LR = 0.1

FAMILIES = [
    pytest.param(
        f, marks=pytest.mark.skipif(f not in zoo.FAMILIES, reason=f"{f}: its library is missing")
    )
    for f in zoo.HF_FAMILIES + zoo.TORCHVISION_FAMILIES
]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: Any) -> None:
    monkeypatch.setenv("AUTOPIPE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


def _quick_profile(family: str) -> Any:
    model, inputs = zoo.build(family)
    return profile(model, inputs, MeasureOptions(warmup=0, repeat=1), progress=False)


# -- 1. plan, measured and analytic ---------------------------------------------------------

PROFILES: dict[str, Path] = {}
"""Measured profiles saved by step 1, which step 3 plans from (not measured again)."""


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_measured_and_analytic(family: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    model, _ = zoo.build(family)
    out = tmp_path_factory.mktemp(family)
    saved = out / "profile.json"
    for extra in (["--save-profile", str(saved)], ["--device", "a100-80gb"]):
        code = cli.main(
            ["plan", f"{ZOO}:{family}", "--gpus", "2", "--batch-size", "8", "--microbatches"]
            + ["4", "--json", str(out / "plan.json"), "-q", "--no-cache", *extra]
        )
        assert code == 0, (family, extra)
        plan = load_plan(out / "plan.json")
        assert plan.num_stages == 2 and plan.microbatches == 4
        assert plan.profile_mode == ("analytic" if "--device" in extra else "measured")
        units = [u for s in plan.stages for u in s.units]
        names = {n for n, _ in model.named_modules()}
        assert units and all(unit_module(u) in names for u in units), units
    PROFILES[family] = saved


# -- 2. parallelize: outputs and every gradient ----------------------------------------------


def _grad_error(pipelined: torch.nn.Module, reference: torch.nn.Module) -> float:
    got = dict(pipelined.named_parameters(remove_duplicate=False))
    worst = 0.0
    for name, p in reference.named_parameters(remove_duplicate=False):
        assert got[name].grad is not None, f"{name}: no gradient through the pipeline"
        torch.testing.assert_close(
            got[name].grad, p.grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )
        worst = max(worst, float((got[name].grad - p.grad).abs().max()))
    return worst


def _state_error(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """Largest difference of any parameter or buffer (persistent or not) between the two."""
    worst = 0.0
    for kind in ("named_parameters", "named_buffers"):
        got = dict(getattr(model, kind)(remove_duplicate=False))
        for name, want in getattr(reference, kind)(remove_duplicate=False):
            assert name in got, f"{name}: missing"
            torch.testing.assert_close(
                got[name], want, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}"
            )
            if want.is_floating_point():
                worst = max(worst, float((got[name].detach() - want.detach()).abs().max()))
    return worst


@pytest.mark.parametrize("family", FAMILIES)
def test_parallelize_equals_the_plain_model(family: str) -> None:
    """The planned cut and another one: outputs and every gradient of one backward, then
    two SGD steps of ``Pipeline.loss`` (the loss micro-batch by micro-batch, as torchrun
    computes it): every parameter and buffer equals the plain model trained on the batch."""
    import autopipe

    model, inputs = zoo.build(family)
    measured = _quick_profile(family)
    planned = make_plan(measured, PlanRequest(gpus=4, microbatches=4, optimizer="sgd"))
    for plan in (planned, zoo.second_cut(measured, planned)):
        model, inputs = zoo.build(family)
        reference = copy.deepcopy(model)
        pipe = autopipe.parallelize(model, inputs, devices=["cpu"] * 4, plan=plan)
        assert pipe.plan.microbatches == 4 and pipe.num_stages == 4
        out = call_model(pipe, inputs)
        expected = call_model(reference, inputs)
        assert type(out) is type(expected)  # the model's own output class (a ModelOutput)
        for got, want in zip(pytree.tree_leaves(out), pytree.tree_leaves(expected), strict=True):
            if isinstance(want, torch.Tensor):
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        default_loss(out, inputs).backward()
        default_loss(expected, inputs).backward()
        _grad_error(model, reference)
        ref_losses, _ = zoo.reference_training(family, LR, model=reference)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        losses = []
        for _ in range(2):
            optimizer.zero_grad()
            loss = pipe.loss(inputs)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL), plan.balance
        _state_error(model, reference)


# -- 3. torchrun: losses and trained weights --------------------------------------------------


@pytest.fixture(scope="module")
def zoo_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every family's 2-stage plan trained under one torchrun launch."""
    out = tmp_path_factory.mktemp("zoo_runs")
    families = list(zoo.FAMILIES)
    zoo.write_plans(out, families, PROFILES)
    result = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()), str(ROOT / "tests" / "zoo_run.py"),
            str(out), *[f"{family}.{cut}" for family in families for cut in zoo.CUTS],
        ],
        # zoo_run.py calls cli.main([...]) in-process, which cannot re-execute with a fixed
        # hash seed as `python -m autopipe run` does: give every rank the same one here.
        capture_output=True, text=True, cwd=ROOT, timeout=900,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def _check_run(out: Path, family: str, run: str, tmp: Path) -> tuple[float, float]:
    """(largest loss difference, largest difference of a parameter or persistent buffer /
    lr) of ``run`` against one process."""
    ref_losses, ref_weights = zoo.reference_training(family, LR)
    losses = [step["loss"] for step in json.loads((out / f"{run}.json").read_text())["steps"]]
    assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    weights = zoo.load_checkpoint(out / f"{run}.ckpt", tmp)
    assert set(weights) == set(ref_weights)
    worst = 0.0
    for name, want in ref_weights.items():
        torch.testing.assert_close(weights[name], want, rtol=RTOL * LR, atol=ATOL * LR)
        worst = max(worst, float((weights[name].float() - want.float()).abs().max()))
    return max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)), worst / LR


@pytest.mark.parametrize("cut", zoo.CUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_torchrun_trains_like_one_process(
    family: str, cut: str, zoo_runs: Path, tmp_path: Path
) -> None:
    """Losses, every parameter and every persistent buffer after 2 steps."""
    run = f"{family}.{cut}"
    for rank in (0, 1):
        assert (zoo_runs / f"{run}.rank{rank}.rc").read_text() == "0"
    _check_run(zoo_runs, family, run, tmp_path)


def test_use_cache_config_is_turned_off_for_training() -> None:
    import transformers

    cfg = zoo.decoder_config("LlamaConfig")
    cfg.use_cache = True
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with pytest.warns(UserWarning, match=r"use_cache = False for training"):
        graph = trace_units(model, zoo.example_inputs_llama(4))
    assert model.config.use_cache is False
    assert graph.unit_names[-1] == "lm_head"
    # An encoder never reads the cache its config names: nothing to warn about.
    bert = zoo.bert()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trace_units(bert, zoo.example_inputs_bert(4))
    assert bert.config.use_cache is False
    assert not [w for w in seen if "use_cache" in str(w.message)]


def test_an_encoder_inside_a_wrapper_gets_no_cache_warning() -> None:
    """Before, only the top module was asked whether it generates: a user's own module
    holding a BERT encoder (a classifier head on top) was told "a key/value cache is for
    generation". The modules whose cache was switched off are asked instead."""
    import transformers

    class Classifier(nn.Module):
        def __init__(self, encoder: nn.Module) -> None:
            super().__init__()
            self.encoder = encoder
            self.head = nn.Linear(32, 2)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(input_ids=input_ids).last_hidden_state[:, 0])

    torch.manual_seed(0)
    bert = Classifier(transformers.BertModel(zoo.bert().config))
    assert bert.encoder.config.use_cache is True
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trace_units(bert, zoo.example_inputs_bert(4)["input_ids"])
    assert bert.encoder.config.use_cache is False
    assert not [w for w in seen if "use_cache" in str(w.message)]
    # A decoder in the same wrapper still reads its cache when generating: said.
    cfg = zoo.decoder_config("LlamaConfig")
    cfg.use_cache = True
    torch.manual_seed(0)
    llama = _LogitsOf(transformers.LlamaForCausalLM(cfg))
    with pytest.warns(UserWarning, match=r"LlamaForCausalLM.config.use_cache = False"):
        trace_units(llama, zoo.example_inputs_llama(4)["input_ids"])


class _LogitsOf(nn.Module):
    """A user's wrapper returning a causal LM's logits."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids).logits


def test_a_mask_drawn_inside_forward_is_refused_naming_the_switch(capsys: Any) -> None:
    """SpecAugment's numpy mask would be replayed as a constant of the traced graph: one
    line naming the config switch (and the input that can carry the mask, where forward
    takes one), exit 2."""
    import transformers

    for cls, carrier in (
        (transformers.Wav2Vec2ForCTC, None),
        (transformers.Wav2Vec2Model, "mask_time_indices"),
    ):
        model = cls(zoo._wav2vec2_config(mask_time_prob=0.05))
        with pytest.raises(TraceError, match=r"config.mask_time_prob = 0\b") as info:
            trace_units(model, zoo.example_inputs_wav2vec2(4))
        assert (carrier is not None) == (f"pass {carrier}" in str(info.value))
    code = cli.main(["plan", f"{ZOO}:wav2vec2_masked", "--gpus", "2", "--batch-size", "8", "-q"])
    assert code == 0  # the mask given as an input: plans as configured
    capsys.readouterr()


def test_tied_embedding_is_charged_to_every_stage_that_holds_it() -> None:
    """GPT-2's embedding and head are one parameter on the first and last stage: each of the
    two stages pays for its copy (parameters, gradients and optimizer state)."""
    measured = _quick_profile("gpt2")
    wte = next(u for u in measured.units if u.name == "transformer.wte")
    head = next(u for u in measured.units if u.name == "lm_head")
    assert wte.shared_parameters == head.shared_parameters == ["transformer.wte.weight"]
    plan = make_plan(measured, PlanRequest(gpus=2, microbatches=2))
    first, last = plan.stages
    assert "transformer.wte" in first.units and "lm_head" in last.units
    assert first.parameter_bytes >= wte.parameter_bytes
    assert last.parameter_bytes >= head.parameter_bytes == wte.parameter_bytes
