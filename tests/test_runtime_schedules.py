"""The one-process executor runs each plan's own per-rank orders (``Pipeline.step``).

Every schedule the planner can emit trains with the gradients of the unsplit model, each rank
runs exactly the plan's order (``autopipe/core/schedules.py:rank_orders``), 1F1B holds fewer
micro-batches' activations than GPipe, and a non-GPipe plan is not silently run fill-drain by
``pipe(x)`` + ``loss.backward()``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from autopipe.profiler.units import trace_units
from autopipe.runtime.activations import ActivationMeter
from autopipe.runtime.executor import ScheduleOrderError
from autopipe.runtime.parallelize import build_pipeline
from autopipe.runtime.pipeline import ScheduleNeedsStepError
from runtime_helpers import assert_close, load_example, reference_forward
from torch import nn

from autopipe.core.plan import Plan, StagePlan
from autopipe.core.schedule_rules import chunk_ranks
from autopipe.core.schedules import rank_orders
from autopipe.core.timeline import Action
from autopipe.parallelizing import parallelize

gpt = load_example("gpt")
CFG = {"vocab_size": 48, "seq_len": 8, "d_model": 16, "n_layer": 4, "n_head": 2}


def tiny_gpt() -> nn.Module:
    torch.manual_seed(0)
    return gpt.build_model(**CFG, dropout=0.1, tie_weights=True)


def tokens(batch: int) -> torch.Tensor:
    torch.manual_seed(1)
    return gpt.example_inputs(batch, gpt.GPTConfig(**CFG))


def schedule_plan(
    unit_names: list[str], schedule: str, ranks: int, virtual: int, microbatches: int,
    checkpoint: bool = False,
) -> Plan:  # fmt: skip
    """``ranks x virtual`` chunks of about equal unit counts, placed as ``schedule`` places them."""
    chunks = ranks * virtual
    bounds = [round(c * len(unit_names) / chunks) for c in range(chunks + 1)]
    placed = chunk_ranks(schedule, ranks, virtual)
    stages = [
        StagePlan(
            index=c,
            device="cpu",
            units=unit_names[bounds[c] : bounds[c + 1]],
            checkpoint=checkpoint,
            rank=placed[c],
        )  # fmt: skip
        for c in range(chunks)
    ]
    return Plan(ranks, microbatches, 0, 0, stages, schedule=schedule, virtual_stages=virtual)


CASES = [
    ("gpipe", 2, 1, 4),
    ("1f1b", 3, 1, 4),
    ("interleaved-1f1b", 2, 2, 4),
    ("looped-bfs", 2, 2, 4),
    ("interleaved-zb", 2, 2, 4),
    ("zbv", 2, 2, 4),
    ("dualpipev", 2, 2, 4),
]


@pytest.mark.parametrize(("schedule", "ranks", "virtual", "microbatches"), CASES)
def test_every_schedule_trains_as_the_unsplit_model_in_the_plans_order(
    schedule: str, ranks: int, virtual: int, microbatches: int
) -> None:
    model, idx = tiny_gpt(), tokens(8)
    reference = copy.deepcopy(model)
    names = trace_units(model, idx).unit_names
    plan = schedule_plan(names, schedule, ranks, virtual, microbatches)
    pipe = parallelize(model, idx, ["cpu"] * ranks, plan=plan)
    orders = rank_orders(schedule, ranks, virtual, microbatches)
    assert pipe.orders == orders and pipe.schedule == schedule
    torch.manual_seed(4)
    loss = pipe.step(idx, loss_fn=gpt.loss_fn)
    # The executed order of every rank is the plan's, action for action.
    assert pipe.last_actions == orders
    expected = gpt.loss_fn(reference_forward(reference, (idx,), microbatches, seed=4), idx)
    expected.backward()
    assert_close(loss, expected.detach(), "loss")
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None, name
        assert_close(p.grad, q.grad, f"grad of {name}")
    # The timeline holds each action once, under its phase.
    timeline = pipe.last_timeline
    ran = {(t.stage, t.microbatch, t.phase) for t in timeline.tasks if t.phase != "loss"}
    assert ran >= {tuple(a) for order in orders for a in order}


def test_the_executor_runs_the_plans_actions_as_they_are() -> None:
    """``parallelize(plan=)`` runs the plan's ``actions`` field, not an order recomputed from
    its schedule (#37): a 1F1B plan whose actions were set to the fill-drain order runs
    fill-drain, action for action, with the unsplit model's loss."""
    model, idx = tiny_gpt(), tokens(8)
    reference = copy.deepcopy(model)
    plan = schedule_plan(trace_units(model, idx).unit_names, "1f1b", 2, 1, 4)
    assert plan.actions == rank_orders("1f1b", 2, 1, 4)
    plan.actions = rank_orders("gpipe", 2, 1, 4)  # another order the executor can run
    pipe = parallelize(model, idx, ["cpu"] * 2, plan=plan)
    torch.manual_seed(4)
    loss = pipe.step(idx, loss_fn=gpt.loss_fn)
    assert pipe.last_actions == plan.actions != rank_orders("1f1b", 2, 1, 4)
    expected = gpt.loss_fn(reference_forward(reference, (idx,), 4, seed=4), idx)
    assert_close(loss, expected.detach(), "loss")


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_ranks_on_worker_threads_run_the_plans_order(schedule: str) -> None:
    """Ranks on different devices ("cpu" and "cpu:0" are two workers) run at once, each in
    its own order, with the unsplit model's gradients."""
    model, idx = tiny_gpt(), tokens(8)
    reference = copy.deepcopy(model)
    virtual = 2 if schedule == "zbv" else 1
    plan = schedule_plan(trace_units(model, idx).unit_names, schedule, 2, virtual, 4)
    pipe = parallelize(model, idx, ["cpu", "cpu:0"], plan=plan)
    torch.manual_seed(3)
    pipe.step(idx, loss_fn=gpt.loss_fn)
    assert pipe.last_actions == rank_orders(schedule, 2, virtual, 4)
    gpt.loss_fn(reference_forward(reference, (idx,), 4, seed=3), idx).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert_close(p.grad, q.grad, "gradient")


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-zb"])
def test_step_with_checkpointed_stages_adds_to_earlier_gradients(schedule: str) -> None:
    """Re-materialized chunks (recomputed inside backward, twice for a split one), and a
    step's gradients added to those already in ``.grad`` (gradient accumulation)."""
    model, idx = tiny_gpt(), tokens(6)
    reference = copy.deepcopy(model)
    names = trace_units(model, idx).unit_names
    plan = schedule_plan(names, schedule, 2, 1, 3, checkpoint=True)
    pipe = parallelize(model, idx, ["cpu"] * 2, plan=plan, checkpoint="auto")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    torch.manual_seed(7)
    pipe.step(idx, loss_fn=gpt.loss_fn)
    assert pipe.last_timeline.of("recompute")
    gpt.loss_fn(reference_forward(reference, (idx,), 3, seed=7), idx).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert_close(p.grad, q.grad + 1, "accumulated gradient")


def _peak_saved_bytes(schedule: str, ranks: int, microbatches: int) -> int:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(ranks)])
    x = torch.randn(microbatches * 4, 64)
    names = trace_units(model, x).unit_names
    plan = schedule_plan(names, schedule, ranks, 1, microbatches)
    pipe = build_pipeline(
        model, x, plan, ["cpu"] * ranks, orders=rank_orders(schedule, ranks, 1, microbatches)
    )
    pipe.activation_meter = meter = ActivationMeter(pipe.parameters())
    pipe.step(x)
    assert meter.current_bytes == 0  # every backward freed what its forward saved
    return meter.peak_bytes


def test_1f1b_holds_fewer_activations_than_gpipe() -> None:
    """GPipe keeps all M micro-batches' activations until the first backward; 1F1B at most
    K - rank on each rank. Counted in bytes saved for backward, not time."""
    ranks, microbatches = 2, 8
    gpipe = _peak_saved_bytes("gpipe", ranks, microbatches)
    one_f_one_b = _peak_saved_bytes("1f1b", ranks, microbatches)
    # A stage saves its Linear's input and its Tanh's output, 4 rows x 64 floats each; a
    # stage's output is the next one's input (the same bytes, counted once): K + 1 tensors
    # per micro-batch. GPipe holds every micro-batch; 1F1B rank 0 holds two (F0, F1 before
    # B0: 3 tensors), rank 1 one (its input is rank 0's output: 2 more).
    tensor = 4 * 64 * 4
    assert gpipe == microbatches * (ranks + 1) * tensor
    assert one_f_one_b == 5 * tensor


def test_training_a_non_gpipe_plan_through_forward_is_refused() -> None:
    model, idx = tiny_gpt(), tokens(4)
    names = trace_units(model, idx).unit_names
    pipe = parallelize(model, idx, ["cpu"] * 2, plan=schedule_plan(names, "1f1b", 2, 1, 2))
    with pytest.raises(ScheduleNeedsStepError, match=r"runs 1f1b.*pipe\.step"):
        pipe(idx)
    with pytest.raises(ScheduleNeedsStepError, match="Pipeline.step|pipe.step"):
        pipe.loss(idx, loss_fn=gpt.loss_fn)
    with torch.no_grad():  # inference runs every chunk in model order: allowed
        assert pipe(idx).shape[0] == 4


def test_build_pipeline_refuses_a_non_gpipe_plan_without_its_orders() -> None:
    model, idx = tiny_gpt(), tokens(4)
    plan = schedule_plan(trace_units(model, idx).unit_names, "1f1b", 2, 1, 2)
    with pytest.raises(ValueError, match="runs 1f1b: build_pipeline needs its per-rank orders"):
        build_pipeline(model, idx, plan, ["cpu"] * 2)


def test_orders_that_skip_or_deadlock_are_refused() -> None:
    model, idx = tiny_gpt(), tokens(4)
    plan = schedule_plan(trace_units(model, idx).unit_names, "1f1b", 2, 1, 2)
    good = rank_orders("1f1b", 2, 1, 2)
    missing = [good[0][:-1], good[1]]
    pipe = build_pipeline(model, idx, plan, ["cpu"] * 2, orders=missing)
    with pytest.raises(ScheduleOrderError, match="chunk 0's micro-batch 1"):
        pipe.step(idx, loss_fn=gpt.loss_fn)
    # Rank 1 runs micro-batch 1's backward before its forward: it can never run.
    stuck = [good[0], [Action(1, 0, "forward"), Action(1, 1, "backward"),
                       Action(1, 1, "forward"), Action(1, 0, "backward")]]  # fmt: skip
    pipe = build_pipeline(model, idx, plan, ["cpu"] * 2, orders=stuck)
    with pytest.raises(ScheduleOrderError, match="rank 1 at 1B1"):
        pipe.step(idx, loss_fn=gpt.loss_fn)


def test_bench_measures_the_plans_order() -> None:
    """``autopipe bench`` (measure_steps) trains a 1F1B plan in 1F1B's order, as its
    timeline shows stage by stage, and refuses before training a plan with several chunks
    per rank on shared devices (which it could not predict)."""
    from autopipe.runtime.step_measurement import measure_steps

    from autopipe.bench_report import run_bench

    model, idx = tiny_gpt(), tokens(8)
    names = trace_units(model, idx).unit_names
    plan = schedule_plan(names, "1f1b", 2, 1, 4)
    orders = rank_orders("1f1b", 2, 1, 4)
    run = measure_steps(
        model, idx, plan, devices=["cpu"] * 2, steps=1, warmup=0, loss_fn=gpt.loss_fn,
        orders=orders, clock="wall",
    )  # fmt: skip
    tasks = sorted(run.steps[0].timeline.tasks, key=lambda t: t.start_s)
    for rank, order in enumerate(orders):
        assert [t.action for t in tasks if t.stage == rank and t.phase != "recompute"] == order
    looped = schedule_plan(names, "interleaved-1f1b", 2, 2, 4)
    with pytest.raises(ValueError, match="interleaved-1f1b with 2 chunks per rank"):
        run_bench(model, idx, looped, devices=["cpu"] * 2, steps=1)
