"""autopipe.runtime.distributed: stage extraction, rank layout, and multi-process runs on gloo
that match single-process training (loss and every gradient) for GPipe and 1F1B."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from autopipe.profiler.units import trace_units
from autopipe.runtime.distributed.layout import PlanWorldSizeError, rank_layout
from autopipe.runtime.distributed.pipeline import build_stage
from autopipe.runtime.distributed.stages import StageModule, split_stages
from autopipe.runtime.planned_stages import stage_of_unit
from autopipe.runtime.split import StageSplitError
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

from autopipe.core.plan import Plan

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


def _six_linear(width: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """Six Linear(width, width) units ``0`` .. ``5`` and a batch of 8."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(6)))
    return model, torch.randn(8, width, generator=torch.Generator().manual_seed(0))


def _measured_plan(model: torch.nn.Module, inputs: object) -> Plan:
    from autopipe.planner import plan
    from autopipe.profiler.measure import profile
    from autopipe.profiler.options import MeasureOptions

    from autopipe.core.request import PlanRequest

    measured = profile(model, inputs, MeasureOptions(warmup=0, repeat=1), progress=False)
    return plan(measured, PlanRequest(gpus=2, microbatches=2, baselines=False))


def test_plan_made_for_a_model_with_the_same_units_and_other_widths_is_refused() -> None:
    """The plan of six Linear(8, 8) on six Linear(32, 32): the same unit names, 16x the
    parameters. Before, only the names were compared and it was built (and trained, exit
    0); now the first unit whose parameters differ is named, before any stage is built,
    for a real and a meta-device model, and by stage bytes for plans without the per-unit
    record."""
    from autopipe.runtime.planned_stages import PlanModelMismatchError, partition

    small, inputs = _six_linear(8)
    plan = _measured_plan(small, inputs)
    assert [s.unit_parameters for s in plan.stages] == [[72] * len(s.units) for s in plan.stages]
    wide, wide_inputs = _six_linear(32)
    for model in (wide, copy.deepcopy(wide).to("meta")):
        with pytest.raises(PlanModelMismatchError) as caught:
            partition(model, wide_inputs, plan)
        assert str(caught.value) == (
            "the plan (made for Sequential) is not for this model: unit '0' has 72 "
            "parameters in the plan but 1,056 in this model (Sequential); re-run "
            "`autopipe plan` on this model"
        )
    old = Plan.from_dict(plan.to_dict())
    for stage in old.stages:
        stage.unit_parameters = []  # a plan written before the record
    first = old.stages[0]
    # a one-unit stage is named by its unit, not "0..0" (#36)
    span = "0" if len(first.units) == 1 else rf"0\.\.{first.units[-1]}"
    with pytest.raises(PlanModelMismatchError, match=(
        rf"stage 0 \({span}\) holds {first.parameter_bytes:,} bytes of "
        rf"parameters in the plan but {(32 * 32 + 32) * 4 * len(first.units):,} in this model"
    )):  # fmt: skip
        partition(wide, wide_inputs, old)
    partition(small, inputs, plan)  # the model it was made for
    partition(copy.deepcopy(small).to("meta"), inputs, plan)
    partition(small, inputs, old)


def test_a_tied_weight_is_checked_in_every_unit_that_holds_it() -> None:
    """GPT's tied embedding and head: the profile charges the one parameter to both units
    (and both stages); the runtime counts it the same way, so the plan fits its model, real
    or on the meta device (counted once, the second unit would differ)."""
    from autopipe.runtime.planned_stages import partition

    tied, inputs, _ = tiny_gpt(tie_weights=True)
    plan = _measured_plan(tied, inputs)
    units = {u: n for s in plan.stages for u, n in zip(s.units, s.unit_parameters, strict=True)}
    assert units["tok_emb"] == units["head"] == 64 * 16
    assert "tok_emb" in plan.stages[0].units and "head" in plan.stages[-1].units
    partition(tied, inputs, plan)
    partition(copy.deepcopy(tied).to("meta"), inputs, plan)


GRAPH_DIGESTS = """\
import sys
sys.path.insert(0, {tests!r})
from autopipe.modelfile import load_model_file
from autopipe.runtime.distributed.agree import graph_fingerprint
from autopipe.runtime.planned_stages import partition
from distributed_cases import make_plan, tiny_gpt

model, inputs, _ = tiny_gpt(tie_weights=True)
units = ["tok_emb", "pos_emb", "drop", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
plan = make_plan([units[:4], units[4:] + ["ln_f", "head"]], 2, 8)
print(graph_fingerprint(partition(model, inputs, plan))["digest"])
mf = load_model_file({set_order!r})
plan = make_plan([["inp", "mid"], ["out"]], 2, 8)
print(graph_fingerprint(partition(mf.build(), mf.inputs(8), plan))["digest"])
"""


def test_graph_fingerprint_differs_between_processes_only_where_the_graph_does(
    tmp_path: Path,
) -> None:
    """Traced in processes with other hash seeds, GPT (tied head) cut for a plan has one
    fingerprint (no object id, node name or hash order in it), the model iterating a set
    of strings has two: what the ranks' start-up agreement compares."""
    import subprocess
    import sys

    from distributed_cases import hash_seeds_with_other_set_orders, set_order_files

    set_order, _ = set_order_files(tmp_path)
    code = GRAPH_DIGESTS.format(tests=str(Path(__file__).parent), set_order=str(set_order))
    digests = [
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True, text=True, check=True, timeout=120,
        ).stdout.split()
        for seed in hash_seeds_with_other_set_orders()
    ]  # fmt: skip
    (gpt_a, set_a), (gpt_b, set_b) = digests
    assert gpt_a == gpt_b
    assert set_a != set_b


def test_graph_and_cut_differences_are_named_in_one_line() -> None:
    from autopipe.runtime.distributed.agree import mismatch

    base = {"plan": {"num_stages": 2}, "model": {"digest": "m", "summary": "M"}}
    graph = {"digest": "g", "stages": ["s0", "s1"], "nodes": [5, 7]}
    other = {"digest": "h", "stages": ["s0", "t1"], "nodes": [5, 8]}
    same = {**base, "graph": graph, "failure": None}
    assert mismatch([same, dict(same)]) is None
    assert mismatch([same, {**same, "graph": other}]) == (
        "rank 1 traced a different graph of the model than rank 0 (stage 1: #t1, 8 nodes on "
        "rank 1; #s1, 7 nodes on rank 0), e.g. a forward that iterates a set; set the same "
        "PYTHONHASHSEED on every rank"
    )
    failed = {**base, "graph": None, "failure": "StageSplitError: no"}
    line = mismatch([same, same, failed])
    assert line is not None and line.startswith(
        "rank 2 could not cut the model into the plan's stages (StageSplitError: no) but rank "
        "0 could;"
    )
    assert mismatch([failed, dict(failed)]) is None  # alike: each rank raises its own


def test_tied_weights_across_stages_are_found_with_every_name() -> None:
    from autopipe.runtime.planned_stages import tied_parameters

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


def test_a_state_dict_of_another_shape_names_the_parameter_and_both_shapes() -> None:
    model, inputs, _ = tiny_gpt()
    units = [u for u in trace_units(model, inputs).unit_names]
    plan = make_plan([units[:4], units[4:]], 2, 8)
    with torch.device("meta"):
        meta_model = copy.deepcopy(model).to("meta")
    other = model.state_dict()
    other["ln_f.weight"] = torch.zeros(2 * other["ln_f.weight"].shape[0])
    with pytest.raises(StageSplitError) as err:
        build_stage(meta_model, plan, inputs, 1, state_dict=other)
    n = model.state_dict()["ln_f.weight"].shape[0]
    assert str(err.value) == (
        f"the state_dict's 'ln_f.weight' has shape [{2 * n}] but the model's is [{n}]; save "
        "it from the same model with model.state_dict()"
    )


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
    from autopipe.runtime.planned_stages import cut_values

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
