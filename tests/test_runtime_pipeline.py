"""Pipeline / parallelize over split fx graphs: any traceable model, skips, tied weights."""

from __future__ import annotations

import copy

import pytest
import torch
from autopipe.profiler.options import MeasureOptions
from autopipe.profiler.units import trace_units
from autopipe.runtime import Pipeline
from runtime_helpers import assert_close, load_example, reference_forward
from torch import nn

from autopipe.core.plan import Plan, StagePlan
from autopipe.parallelizing import parallelize

gpt = load_example("gpt")
CFG = {"vocab_size": 48, "seq_len": 8, "d_model": 16, "n_layer": 4, "n_head": 2}


def tiny_gpt(dropout: float = 0.1) -> nn.Module:
    return gpt.build_model(**CFG, dropout=dropout, tie_weights=True)


def tokens(batch: int) -> torch.Tensor:
    return gpt.example_inputs(batch, gpt.GPTConfig(**CFG))


def hand_plan(
    unit_names: list[str], balance: list[int], microbatches: int, checkpoint: list[bool]
) -> Plan:
    stages, start = [], 0
    for j, (count, ckpt) in enumerate(zip(balance, checkpoint, strict=True)):
        stages.append(
            StagePlan(
                index=j, device="cpu", units=unit_names[start : start + count], checkpoint=ckpt
            )
        )
        start += count
    return Plan(len(balance), microbatches, 0, 0, stages)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


def assert_model_grads(model: nn.Module, reference: nn.Module) -> None:
    got, want = grads_of(model), grads_of(reference)
    assert got.keys() == want.keys()
    for name, g in want.items():
        assert got[name] is not None, f"{name}: no gradient through the pipeline"
        assert_close(got[name], g, f"grad of {name}")


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 2, 4, 7])
def test_gpt_with_dropout_and_tied_head_matches_unpipelined(checkpoint: str, chunks: int) -> None:
    model, idx = tiny_gpt(), tokens(9)
    assert model.head.weight is model.tok_emb.weight
    reference = copy.deepcopy(model)
    ug = trace_units(model, idx)
    n = ug.num_units
    plan = hand_plan(ug.unit_names, [2, 3, n - 7, 2], chunks, [False] * 4)
    pipe = parallelize(model, idx, ["cpu"] * 4, plan=plan, checkpoint="auto")
    pipe.checkpoint = checkpoint  # the torchgpipe-style mode, applied to every stage
    assert pipe.plan is plan and pipe.microbatches == chunks
    # One tied parameter, used by stage 0 (embedding) and stage 3 (head), counted once.
    assert sum(p.numel() for p in pipe.parameters()) == sum(p.numel() for p in model.parameters())
    torch.manual_seed(4)
    out = pipe(idx)
    gpt.loss_fn(out, idx).backward()
    expected = reference_forward(reference, (idx,), chunks, seed=4)
    gpt.loss_fn(expected, idx).backward()
    assert_close(out, expected, "logits")
    assert_model_grads(model, reference)
    if checkpoint != "never" and chunks > 1:
        assert pipe.last_timeline.of("recompute")


def test_gpt_training_loss_curve_matches_gradient_accumulation() -> None:
    model, idx = tiny_gpt(), tokens(8)
    reference = copy.deepcopy(model)
    ug = trace_units(model, idx)
    plan = hand_plan(ug.unit_names, [4, 2, ug.num_units - 6], 4, [True, False, True])
    pipe = parallelize(model, idx, plan=plan)
    assert pipe.devices == [torch.device("cpu")] * 3 and pipe.checkpoint == [True, False, True]
    opt_pipe = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    curves: tuple[list[float], list[float]] = ([], [])
    for step in range(4):
        for opt, curve, run in (
            (opt_pipe, curves[0], lambda s=step: (torch.manual_seed(s), pipe(idx))[1]),
            (opt_ref, curves[1], lambda s=step: reference_forward(reference, (idx,), 4, seed=s)),
        ):
            opt.zero_grad()
            loss = gpt.loss_fn(run(), idx)
            loss.backward()
            opt.step()
            curve.append(loss.item())
    assert curves[0] == pytest.approx(curves[1], rel=1e-5)
    assert curves[0][-1] < curves[0][0]


class SkipNet(nn.Module):
    """A mask and the input skip over several stages; kwargs input; dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h)) * mask
        return {"y": self.out(h + x), "h": h}


@pytest.mark.parametrize("devices", [["cpu"] * 4, ["cpu", "cpu:0", "cpu", "cpu:0"]])
@pytest.mark.parametrize("chunks", [1, 3])
def test_skip_connections_and_masks_cross_stages(chunks: int, devices: list[str]) -> None:
    torch.manual_seed(0)
    model = SkipNet()
    x, mask = torch.randn(6, 6, requires_grad=True), (torch.rand(6, 6) > 0.3).float()
    reference = copy.deepcopy(model)
    ug = trace_units(model, (x, mask))
    plan = hand_plan(ug.unit_names, [1, 1, 1, ug.num_units - 3], chunks, [True, False, True, False])
    pipe = parallelize(model, (x, mask), devices, plan=plan)
    # x and mask are needed by later stages: they are carried through the stages between.
    assert all(len(g.input_names) >= 2 for g in pipe._graphs[1:])
    out = pipe(x, mask=mask)
    (out["y"].sum() + out["h"].square().sum()).backward()
    x_grad = x.grad.clone()
    x.grad = None
    expected = reference(x, mask)
    (expected["y"].sum() + expected["h"].square().sum()).backward()
    assert_close(out["y"], expected["y"], "y")
    assert_close(x_grad, x.grad, "input gradient")
    assert_model_grads(model, reference)


def small_resnet() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = load_example("resnet").resnet(widths=(4, 8), blocks_per_stage=1, num_classes=5)
    return model, torch.randn(8, 3, 8, 8)


def test_resnet_pipeline_matches_microbatched_model() -> None:
    model, x = small_resnet()
    reference = copy.deepcopy(model)
    ug = trace_units(model, x)
    plan = hand_plan(ug.unit_names, [2, 1, ug.num_units - 3], 4, [True, True, False])
    pipe = parallelize(model, x, ["cpu"] * 3, plan=plan)
    torch.manual_seed(3)
    out = pipe(x)
    out.sum().backward()
    expected = reference_forward(reference, (x,), 4, seed=3)
    expected.sum().backward()
    assert_close(out, expected, "output")
    assert_model_grads(model, reference)
    for (name, buf), ref in zip(model.named_buffers(), reference.buffers(), strict=True):
        assert_close(buf, ref, name)


def test_plan_for_other_units_is_refused() -> None:
    model, idx = tiny_gpt(0.0), tokens(2)
    ug = trace_units(model, idx)
    plan = hand_plan(
        [f"u{i}" for i in range(ug.num_units)], [1, ug.num_units - 1], 1, [False, False]
    )
    with pytest.raises(ValueError, match="do not match the model's"):
        parallelize(model, idx, plan=plan)
    good = hand_plan(ug.unit_names, [1, ug.num_units - 1], 1, [False, False])
    with pytest.raises(ValueError, match="3 devices"):
        parallelize(model, idx, ["cpu"] * 3, plan=good)


def test_parallelize_profiles_and_plans() -> None:
    """No plan given: measure a Profile, plan 3 stages, run; the cuts line up with the units."""
    model, idx = tiny_gpt(0.0), tokens(8)
    reference = copy.deepcopy(model)
    pipe = parallelize(
        model,
        idx,
        gpus=3,
        microbatches=4,
        checkpoint="always",
        profile_options=MeasureOptions(warmup=1, repeat=1),
        loss_fn=gpt.loss_fn,
        progress=False,
    )
    assert pipe.plan.num_stages == pipe.num_stages == 3
    assert pipe.microbatches == pipe.plan.microbatches == 4 and pipe.checkpoint == [True] * 3
    assert pipe.devices == [torch.device("cpu")] * 3
    torch.manual_seed(0)
    out = pipe(idx)
    out.sum().backward()
    expected = reference_forward(reference, (idx,), 4, seed=0)
    expected.sum().backward()
    assert_close(out, expected, "logits")
    assert_model_grads(model, reference)


class ChunkNet(nn.Module):
    """A tuple (``chunk``) crosses a cut and the model returns a tuple-valued node."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p, q = self.a(x).chunk(2, dim=1)
        return self.b(torch.cat([q, p], 1)).chunk(2, dim=1)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_tensors_inside_tuples_get_gradients(checkpoint: str) -> None:
    torch.manual_seed(0)
    model, x = ChunkNet(), torch.randn(6, 4, requires_grad=True)
    reference = copy.deepcopy(model)
    ug = trace_units(model, x, granularity="node")
    first = {"x", "a", "chunk"}  # the tuple `chunk` is unpacked by stage 1
    node_stage = {name: 0 if name in first else 1 for name in ug.node_unit}
    flags = [checkpoint == "always"] * 2
    pipe = Pipeline(ug.graph_module, node_stage, ["cpu", "cpu:0"], microbatches=3, checkpoint=flags)
    out = pipe(x)
    sum(o.square().sum() for o in out).backward()
    x_grad, x.grad = x.grad.clone(), None
    expected = reference(x)
    sum(o.square().sum() for o in expected).backward()
    for got, want in zip(out, expected, strict=True):
        assert_close(got, want, "output")
    assert_close(x_grad, x.grad, "input gradient")
    assert_model_grads(model, reference)


def test_parameter_returned_by_the_model_reaches_the_output() -> None:
    class ReturnsWeight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.b(self.a(x)), self.a.weight

    model = ReturnsWeight()
    gm = torch.fx.symbolic_trace(model)
    calls = {n.name: int(n.name == "b") for n in gm.graph.nodes if n.op == "call_module"}
    pipe = Pipeline(gm, calls, ["cpu", "cpu"])
    x = torch.randn(2, 3)
    out, weight = pipe(x)
    assert torch.equal(weight, model.a.weight)
    assert_close(out, model(x)[0], "output")


class _ExportedNorm(nn.Module):
    """fx cannot trace the rank test, so torch.export does: BatchNorm becomes an operation."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if x.dim() == 2:
            x = self.bn(x)
        return self.b(x)


def test_deferred_batch_norm_on_an_exported_graph_is_refused() -> None:
    model, x = _ExportedNorm(), torch.randn(4, 4)
    ug = trace_units(model, x)
    assert ug.tracer == "export"
    plan = hand_plan(ug.unit_names, [2, 1], 2, [False, False])
    with pytest.raises(ValueError, match="needs BatchNorm modules"):
        parallelize(model, x, ["cpu", "cpu"], plan=plan, deferred_batch_norm=True)
    parallelize(model, x, ["cpu", "cpu"], plan=plan)(x).sum().backward()  # without: it runs


def test_checkpoint_words_have_one_meaning_each() -> None:
    """The planner's modes are per stage and become one flag per stage; Pipeline takes only
    those flags (a torchgpipe word there used to switch to per-micro-batch meaning)."""
    from autopipe.core.checkpointing import stage_checkpoints

    assert stage_checkpoints("except_last", [False] * 3) == [True, True, False]
    assert stage_checkpoints("auto", [False, True, False]) == [False, True, False]
    assert stage_checkpoints("always", [False] * 2) == [True, True]
    with pytest.raises(ValueError, match="checkpoint is not one of"):
        stage_checkpoints("sometimes", [False])
    model, idx = tiny_gpt(0.0), tokens(2)
    ug = trace_units(model, idx)
    node_stage = {k: (0 if u < 2 else 1) for k, u in ug.node_unit.items()}
    with pytest.raises(TypeError, match="one bool per stage"):
        Pipeline(ug.graph_module, node_stage, ["cpu", "cpu"], checkpoint="except_last")  # type: ignore[arg-type]
