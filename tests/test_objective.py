"""The objective (autopipe.profiler.objective): one loss, computed micro-batch by micro-batch
in every runtime and combined as the sum of the sums over the sum of the counts.

- the rule by which a model's own loss counts its items (Hugging Face's loss types);
- combining micro-batch terms equals the whole batch's mean however the items fall
  (hypothesis);
- a ``loss_fn`` returning ``(sum, count)``, with a micro-batch that counts nothing: the
  one-process pipeline and torchrun both train exactly like the plain model;
- a ``loss_fn`` that reads row positions: the one-process pipeline (``Pipeline.loss``) and
  torchrun give the same losses and parameters (both see micro-batches).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from autopipe.planner import plan as make_plan
from autopipe.profiler.inputs import call_model
from autopipe.profiler.measure import profile
from autopipe.profiler.objective import (
    LabelItems,
    LossTerm,
    ObjectiveError,
    combine,
    loss_of,
    loss_term,
)
from autopipe.profiler.options import MeasureOptions
from distributed_cases import free_port
from hypothesis import given, settings
from hypothesis import strategies as st

import autopipe
from autopipe.core.request import PlanRequest
from autopipe.modelfile import load_model_file

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
LR = 0.1
STEPS = 2


# -- the rule and the arithmetic -------------------------------------------------------------


def test_label_items_follow_the_models_own_loss() -> None:
    transformers = pytest.importorskip("transformers")
    import zoo

    assert LabelItems.of(zoo.llama()) == LabelItems(shifted=True)  # ForCausalLM
    assert LabelItems.of(zoo.gpt2()) == LabelItems(shifted=True)  # no loss type: causal
    assert LabelItems.of(zoo.bert()) == LabelItems(shifted=False)  # ForMaskedLM
    assert LabelItems.of(zoo.t5()) == LabelItems(shifted=False)  # encoder-decoder
    assert LabelItems.of(zoo.swin()) == LabelItems(shifted=False)  # image classification
    assert LabelItems.of(torch.nn.Linear(2, 2)) == LabelItems(shifted=False)
    labels = torch.tensor([[5, -100, 7, 8], [-100, -100, 1, 2]])
    assert LabelItems(shifted=False).count({"labels": labels}) == 5
    assert LabelItems(shifted=True).count({"labels": labels}) == 5 - 1  # column 0 unused
    assert LabelItems().count({"input_ids": labels}) == 2  # no labels: rows
    # The count is exactly what the model's own loss averages over.
    model = zoo.llama()
    inputs = zoo.example_inputs_llama_labels(4)
    out = call_model(model, inputs)
    logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
    summed = torch.nn.functional.cross_entropy(
        logits, inputs["labels"][:, 1:].reshape(-1), reduction="sum"
    )
    items = LabelItems.of(model).count(inputs)
    torch.testing.assert_close(out.loss * items, summed)
    assert transformers is not None


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(st.floats(0.0, 10.0), min_size=1, max_size=24),
    st.lists(st.integers(1, 6), min_size=1, max_size=6),
    st.lists(st.booleans(), min_size=24, max_size=24),
)
def test_combined_terms_are_the_whole_batch_mean(
    item_losses: list[float], cuts: list[int], ignored: list[bool]
) -> None:
    """Per-item losses, some ignored, cut into micro-batches anywhere: the combined terms
    (mean-returning and (sum, count) alike) equal the mean over the counted items."""
    values = torch.tensor(item_losses, dtype=torch.float64)
    keep = torch.tensor([not x for x in ignored[: len(item_losses)]])
    bounds = [0]
    for c in cuts:
        bounds.append(min(bounds[-1] + c, len(item_losses)))
    bounds[-1] = len(item_losses)
    terms = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        if hi <= lo:
            continue
        part, mask = values[lo:hi], keep[lo:hi]
        terms.append(LossTerm(part[mask].sum(), float(mask.sum())))
    expected = values[keep].mean() if bool(keep.any()) else torch.zeros((), dtype=torch.float64)
    torch.testing.assert_close(combine(terms).double(), expected)


def test_loss_fn_results_are_checked() -> None:
    out = torch.ones(4, 3, requires_grad=True)
    inputs = torch.zeros(4, 2)
    mean = loss_term(out, inputs, lambda o, _: o.mean())
    assert mean.items == 4.0
    torch.testing.assert_close(mean.total, out.mean() * 4)
    pair = loss_term(out, inputs, lambda o, _: (o.sum(), torch.tensor(12)))
    assert pair.items == 12.0
    torch.testing.assert_close(loss_of(out, inputs, lambda o, _: (o.sum(), 12)), out.mean())
    with pytest.raises(ObjectiveError, match=r"\(sum, count\)"):
        loss_term(out, inputs, lambda o, _: o)
    with pytest.raises(ObjectiveError, match="sequence of 3"):
        loss_term(out, inputs, lambda o, _: (o.sum(), 1, 2))
    # A micro-batch whose model loss counts nothing adds zero, not NaN.
    own = {"loss": torch.tensor(float("nan"), requires_grad=True), "logits": out}
    term = loss_term(own, {"labels": torch.full((4, 2), -100)}, None, LabelItems())
    assert term.items == 0.0 and float(term.total.detach()) == 0.0
    term.total.backward()
    assert out.grad is not None and not out.grad.isnan().any()


# -- every runtime trains the same way -----------------------------------------------------


def _plan(model_file: Path, directory: Path) -> Path:
    mf = load_model_file(str(model_file))
    measured = profile(
        mf.build(),
        mf.inputs(8),
        MeasureOptions(warmup=0, repeat=1),
        progress=False,
        loss_fn=mf.loss_fn,
    )
    plan = make_plan(
        measured,
        PlanRequest(gpus=2, batch_size=8, microbatches=4, optimizer="sgd", schedule="1f1b"),
    )
    path = directory / f"{model_file.stem}.plan.json"
    plan.save(path)
    return path


def _one_process(model_file: Path, plan_path: Path) -> tuple[list[float], dict[str, Any]]:
    """The one-process pipeline trained with ``Pipeline.step`` (SGD), in the plan's 1F1B
    order (``pipe.loss(...).backward()`` would run it fill-drain: refused)."""
    from autopipe.core.plan import load_plan

    mf = load_model_file(str(model_file))
    model, inputs = mf.build(), mf.inputs(8)
    pipe = autopipe.parallelize(model, inputs, devices=["cpu"] * 2, plan=load_plan(plan_path))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = pipe.step(inputs, loss_fn=mf.loss_fn)
        optimizer.step()
        losses.append(float(loss))
    return losses, model.state_dict()


def _torchrun(model_file: Path, plan_path: Path, tmp: Path) -> tuple[list[float], dict[str, Any]]:
    import zoo

    log, ckpt = tmp / f"{model_file.stem}.json", tmp / f"{model_file.stem}.ckpt"
    out = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()), "-m", "autopipe", "run", str(model_file),
            "--plan", str(plan_path), "--steps", str(STEPS), "--lr", str(LR),
            "--timeout", "60", "-q", "--json", str(log), "--save", str(ckpt),
        ],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [s["loss"] for s in json.loads(log.read_text())["steps"]]
    return losses, zoo.load_checkpoint(ckpt, tmp)


def _plain(model_file: Path) -> tuple[list[float], dict[str, Any]]:
    """The plain model trained on the whole batch, ``loss_fn`` called once on it."""
    mf = load_model_file(str(model_file))
    model, inputs = mf.build(), mf.inputs(8)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = loss_of(call_model(model, inputs), inputs, mf.loss_fn)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, model.state_dict()


def _assert_same(
    a: tuple[list[float], dict[str, Any]], b: tuple[list[float], dict[str, Any]]
) -> None:
    assert a[0] == pytest.approx(b[0], rel=1e-5, abs=1e-6)
    assert set(a[1]) == set(b[1])
    for name, value in a[1].items():
        torch.testing.assert_close(value, b[1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_summed_loss_with_uneven_counts_trains_like_the_plain_model(tmp_path: Path) -> None:
    """(sum, count) over labelled rows that fall 0, 1, 2 and 2 into the 4 micro-batches:
    the one-process pipeline and torchrun both equal the plain model's mean over them."""
    model_file = TESTS / "summed_loss.py"
    plan_path = _plan(model_file, tmp_path)
    plain = _plain(model_file)
    _assert_same(_one_process(model_file, plan_path), plain)
    _assert_same(_torchrun(model_file, plan_path, tmp_path), plain)


def test_position_dependent_loss_is_the_same_in_one_process_and_under_torchrun(
    tmp_path: Path,
) -> None:
    """A loss_fn whose target is its rows' positions sees micro-batches in both runtimes,
    so they agree; the plain model, which sees the whole batch, trains otherwise."""
    model_file = TESTS / "position_loss.py"
    plan_path = _plan(model_file, tmp_path)
    one = _one_process(model_file, plan_path)
    _assert_same(_torchrun(model_file, plan_path, tmp_path), one)
    assert _plain(model_file)[0][0] != pytest.approx(one[0][0], rel=1e-3)
