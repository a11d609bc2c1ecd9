"""autopipe.runtime.distributed: stage extraction, rank layout, and multi-process runs on gloo
that match single-process training (loss and every gradient) for GPipe and 1F1B."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from autopipe.profiler.units import trace_units
from autopipe.runtime.distributed.layout import PlanWorldSizeError, rank_layout
from autopipe.runtime.distributed.pipeline import build_stage
from autopipe.runtime.distributed.stages import (
    StageModule,
    StageSplitError,
    split_stages,
    stage_of_unit,
)
from distributed_cases import (
    SkipNet,
    job_key,
    make_plan,
    reference,
    run_correctness,
    skipnet_inputs,
    skipnet_loss,
    spawn_ranks,
    tiny_gpt,
)

TOL = 1e-5


def test_rank_layout_is_stage_major() -> None:
    grid = [rank_layout(r, 6, 3) for r in range(6)]
    assert [(g.stage, g.replica) for g in grid] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert grid[3].pipeline_ranks(1) == [1, 3, 5]
    assert grid[3].replica_ranks(1) == [2, 3]
    assert grid[0].is_first_stage and grid[5].is_last_stage


def test_world_size_not_a_multiple_of_stages_is_refused() -> None:
    with pytest.raises(PlanWorldSizeError, match="plan has 4 stages but 6 processes"):
        rank_layout(0, 6, 4)


def _chain(stages: list, inputs: tuple) -> torch.Tensor:
    values = inputs
    for stage in stages:
        values = stage(*values)
    return values


def test_skip_connection_and_late_input_are_relayed() -> None:
    torch.manual_seed(0)
    model, inputs = SkipNet(), skipnet_inputs(4)
    graph = trace_units(model, inputs)
    assert graph.unit_names == ["f1", "f2", "f3", "f4"]
    stages = split_stages(graph, [0, 1, 2, 3])
    # The input `scale` is used only by stage 3 and the skip `tanh` (a = tanh(f1(x)), computed
    # in stage 1 where the glue joins unit f2) only by stage 3: the stages between receive
    # them and pass them on unchanged.
    assert stages[0].output_names == ["scale", "f1"]
    assert stages[1].output_names == ["scale", "tanh", "f2"]
    assert stages[2].input_names == ["scale", "tanh", "f2"]
    assert stages[2].output_names == ["scale", "tanh", "f3"]
    modules = [StageModule(s, checkpoint=s.index % 2 == 0) for s in stages]
    out = _chain(modules, inputs)
    expected = model(*inputs)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # Backward through the chain (two stages re-materialized) equals the model's.
    skipnet_loss(out, inputs).backward()
    ref_model = copy.deepcopy(model)
    ref_model.zero_grad()
    _, ref_grads = reference(ref_model, inputs, skipnet_loss)
    for m in modules:
        for name, p in m.model_named_parameters().items():
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=TOL, atol=1e-6)


def test_each_stage_holds_only_its_parameters() -> None:
    model, inputs, _ = tiny_gpt()
    graph = trace_units(model, inputs)
    stages = split_stages(
        graph, stage_of_unit(graph.unit_names, [graph.unit_names[:4], graph.unit_names[4:]])
    )
    names = [set(dict(s.module.named_parameters())) for s in stages]
    assert names[0].isdisjoint(names[1])
    assert names[0] | names[1] == set(dict(model.named_parameters()))
    assert "head.weight" in names[1] and "tok_emb.weight" in names[0]


def test_plan_for_another_model_is_refused() -> None:
    with pytest.raises(StageSplitError, match="do not match the model's 4 traced units"):
        stage_of_unit(["f1", "f2", "f3", "f4"], [["f1", "f2"], ["f3", "head"]])


def test_tied_weights_across_stages_are_found_with_every_name() -> None:
    from autopipe.runtime.partition import tied_parameters

    model, inputs, _ = tiny_gpt(tie_weights=True)
    graph = trace_units(model, inputs)
    n = len(graph.unit_names)
    stages = split_stages(graph, [0] * (n // 2) + [1] * (n - n // 2))
    (tied,) = tied_parameters([s.module for s in stages], model)
    assert tied.name == "tok_emb.weight" and tied.stages == [0, 1]
    assert tied.names == {0: ["tok_emb.weight"], 1: ["head.weight"]}


def test_meta_build_materialises_one_stage(tmp_path: Path) -> None:
    model, inputs, _ = tiny_gpt()
    units = [u for u in trace_units(model, inputs).unit_names]
    plan = make_plan([units[:4], units[4:]], 2, 8, checkpoint=[False, True])
    with torch.device("meta"):
        meta_model = copy.deepcopy(model).to("meta")
    # From a state_dict: exactly the real model's weights, and nothing of stage 0.
    stage = build_stage(meta_model, plan, inputs, 1, state_dict=model.state_dict())
    own = stage.model_named_parameters()
    assert not any(p.is_meta for p in own.values())
    assert "tok_emb.weight" not in own and stage.checkpoint
    for name, p in own.items():
        torch.testing.assert_close(p, dict(model.named_parameters())[name], rtol=0, atol=0)
    # Without one: PyTorch's default init, seeded per stage, on real storage.
    fresh = build_stage(copy.deepcopy(meta_model), plan, inputs, 1, init_seed=3)
    again = build_stage(copy.deepcopy(meta_model), plan, inputs, 1, init_seed=3)
    for (name, a), b in zip(
        fresh.model_named_parameters().items(), again.parameters(), strict=True
    ):
        assert not a.is_meta and torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _check(results: dict, world_size: int, jobs: list[dict]) -> None:
    for job in jobs:
        key = job_key(job, world_size)
        for rank in range(world_size):
            r = results[rank][key]
            assert r["grad_err"] < TOL, (key, rank, r)
            if r["holds_last"]:
                assert 0 <= r["loss_err"] < TOL and 0 <= r["loss2_err"] < TOL, (key, rank, r)
            else:
                assert r["loss_err"] == -1.0  # only the last stage sees the loss


def _run(world_size: int, jobs: list[dict], tmp_path: Path) -> dict:
    from distributed_cases import free_port

    spawn_ranks(run_correctness, world_size, (world_size, free_port(), str(tmp_path), jobs), 150)
    return {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)}


JOBS_2 = [
    dict(model="skip", stages=2, microbatches=2, schedule="gpipe"),
    dict(model="gpt_tied", stages=2, microbatches=4, schedule="1f1b"),
    dict(model="inplace", stages=2, microbatches=2, schedule="gpipe"),
    dict(model="gpt", stages=2, microbatches=4, schedule="gpipe"),
    dict(model="gpt", stages=2, microbatches=4, schedule="1f1b", checkpoint=[True, False]),
    dict(model="skip", stages=2, microbatches=4, schedule="1f1b"),
]


def test_two_processes_match_single_process(tmp_path: Path) -> None:
    _check(_run(2, JOBS_2, tmp_path), 2, JOBS_2)


JOBS_4 = [
    dict(model="gpt", stages=4, microbatches=4, schedule="1f1b"),
    dict(model="skip", stages=4, microbatches=4, schedule="gpipe", checkpoint=[True] * 4),
    dict(model="skip", stages=2, microbatches=2, schedule="1f1b", checkpoint=[True, True]),
    dict(model="gpt", stages=2, microbatches=2, schedule="gpipe"),
    dict(model="gpt_tied", stages=2, microbatches=2, schedule="gpipe"),
    dict(model="inplace", stages=4, microbatches=4, schedule="1f1b", checkpoint=[True] * 4),
]


@pytest.mark.slow
def test_four_processes_and_2x2_pipeline_data_parallel_match(tmp_path: Path) -> None:
    _check(_run(4, JOBS_4, tmp_path), 4, JOBS_4)


class _SizeAcrossCut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        n = h.size(0)  # a Python int, not a tensor
        return self.b(h).reshape(n, -1)


def test_python_number_crossing_a_cut_travels_as_a_tensor() -> None:
    model, x = _SizeAcrossCut(), torch.randn(2, 4)
    graph = trace_units(model, x, granularity="node")
    assert graph.unit_names == ["a", "size", "b", "reshape"]
    stages = [StageModule(s) for s in split_stages(graph, [0, 0, 1, 1])]
    sent = stages[0](x)
    assert stages[0].output_names == ["a", "size"]
    assert isinstance(sent[1], torch.Tensor) and int(sent[1]) == 2
    torch.testing.assert_close(stages[1](*sent), model(x), rtol=0, atol=0)


def test_symbolic_batch_size_crossing_a_cut_comes_back_as_an_int() -> None:
    # torch.export with a dynamic batch: the batch size is a SymInt node of the first stage
    # that later stages reshape with; it crosses the cut as a 0-dim tensor.
    model, x = _SizeAcrossCut(), torch.randn(4, 4)
    graph = trace_units(model, x, tracer="export")
    assert graph.batch_dynamic
    first, last = split_stages(graph, [0, 1])
    stages = [StageModule(first), StageModule(last, unflatten=graph.unflatten_output)]
    sent = stages[0](x[:3])
    size = sent[first.output_names.index("sym_size_int_1")]
    assert isinstance(size, torch.Tensor) and int(size) == 3
    torch.testing.assert_close(stages[1](*sent), model(x[:3]), rtol=0, atol=0)


def test_recomputed_stage_moves_batchnorm_statistics_once() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2)
    )
    x = torch.randn(8, 4)
    reference = copy.deepcopy(model)
    graph = trace_units(model, x)
    stages = [StageModule(s, checkpoint=True) for s in split_stages(graph, [0, 0, 1])]
    _chain(stages, (x,)).sum().backward()
    reference(x).sum().backward()
    for name, buf in model[1].named_buffers():
        torch.testing.assert_close(buf, dict(reference[1].named_buffers())[name], rtol=0, atol=0)
    assert int(model[1].num_batches_tracked) == 1


class _InputArg(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Linear(3, 3)

    def forward(self, input: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # noqa: A002
        return self.b(self.a(input)) * mask


def test_keyword_inputs_bind_by_argument_name_not_fx_node_name() -> None:
    x, mask = torch.randn(2, 3), torch.ones(2, 3)
    graph = trace_units(_InputArg(), (x, mask))
    stage0 = StageModule(split_stages(graph, [0, 1])[0])
    assert stage0.input_names == ["input_1", "mask"]  # fx renamed the builtin-shadowing node
    args = graph.binder((), {"mask": mask, "input": x})
    assert args[0] is x and args[1] is mask
    assert graph.binder((x,), {"mask": mask}) == args
    with pytest.raises(TypeError, match="no argument 'masks'"):
        graph.binder((x,), {"masks": mask})
    out = dict(zip(stage0.output_names, stage0(*args), strict=True))
    torch.testing.assert_close(out["a"], stage0.body.a(x), rtol=0, atol=0)


class _PairAcrossCut(torch.nn.Module):
    """Unit ``a`` returns ``chunk``'s tuple and unit ``b`` takes it apart: the tuple itself
    crosses the cut."""

    class Split(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return torch.tanh(x).chunk(2, dim=1)

    class Join(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Linear(2, 4)

        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return self.w(pair[0] * pair[1])

    def __init__(self) -> None:
        super().__init__()
        self.a = self.Split()
        self.b = self.Join()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_tuple_crossing_a_cut_travels_leaf_by_leaf() -> None:
    from autopipe.runtime.distributed.stages import wire_of
    from autopipe.runtime.partition import cut_values

    model, x = _PairAcrossCut(), torch.randn(3, 4)
    graph = trace_units(model, x)
    first, last = split_stages(graph, [0, 1])
    assert first.output_names == ["chunk"]  # the tuple itself crosses
    values = cut_values(graph.graph_module, [x], set(last.input_names))
    sender, receiver = StageModule(first), StageModule(last)
    receiver.set_wires([wire_of(values[name]) for name in last.input_names])
    sent = sender(x)
    assert len(sent) == 2 and all(isinstance(t, torch.Tensor) for t in sent)
    out = receiver(*(t.detach().requires_grad_(True) for t in sent))
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
