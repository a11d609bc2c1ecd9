"""Tracer chain, unit grouping and cut tensors (autopipe.profiler.units / trace)."""

from __future__ import annotations

import warnings

import pytest
import torch
from autopipe.profiler.inputs import call_model
from autopipe.profiler.trace import TraceError
from autopipe.profiler.tree import leaves
from autopipe.profiler.units import UnitGraph, cut_tensors, trace_units
from profiler_models import (
    DataBranch,
    DecoderConfig,
    GatedChain,
    GatedStack,
    LSTMTagger,
    ShapeBranch,
    SkipCNN,
    TiedDecoder,
    decoder_inputs,
    load_example,
)
from torch.fx.passes.split_module import split_module

torch.manual_seed(0)


def small_gpt():
    gpt = load_example("gpt")
    return gpt.build_model(n_layer=3, d_model=32, vocab_size=211), gpt.example_inputs(
        2, gpt.GPTConfig(vocab_size=211)
    )


def small_resnet():
    resnet = load_example("resnet")
    return resnet.resnet(widths=(4, 8), blocks_per_stage=2, num_classes=5), resnet.example_inputs(2)


def small_mlp():
    mlp = load_example("mlp")
    return mlp.mlp((16, 32, 32, 8)), torch.randn(3, 16)


GPT_UNITS = ["tok_emb", "pos_emb", "drop", "blocks.0", "blocks.1", "blocks.2", "ln_f", "head"]
RESNET_UNITS = [str(i) for i in range(8)]  # stem, 4 BasicBlocks, pool, flatten, linear
MLP_UNITS = [str(i) for i in range(5)]


@pytest.mark.parametrize(
    ("factory", "expected", "kinds"),
    [
        (
            small_gpt,
            GPT_UNITS,
            ["Embedding", "Embedding", "Dropout", "Block", "Block", "Block", "LayerNorm", "Linear"],
        ),
        (
            small_resnet,
            RESNET_UNITS,
            ["Sequential", *["BasicBlock"] * 4, "AdaptiveAvgPool2d", "Flatten", "Linear"],
        ),
        (small_mlp, MLP_UNITS, ["Linear", "ReLU", "Linear", "ReLU", "Linear"]),
    ],
)
def test_example_units_in_topological_order(factory, expected, kinds) -> None:
    model, x = factory()
    for tracer in ("fx", "export"):
        ug = trace_units(model, x, tracer=tracer)
        assert ug.unit_names == expected, tracer
        assert ug.unit_kinds == kinds, tracer
        assert ug.tracer == tracer


def test_module_granularity_recurses_into_containers() -> None:
    model, x = small_resnet()
    ug = trace_units(model, x, granularity="module")
    assert ug.unit_names == ["0.0", "0.1", "0.2", *[str(i) for i in range(1, 8)]]
    gpt, idx = small_gpt()
    assert trace_units(gpt, idx, granularity="module").unit_names == GPT_UNITS


def test_node_granularity_one_unit_per_call_node() -> None:
    model, x = small_mlp()
    ug = trace_units(model, x, granularity="node")
    calls = [n for n in ug.graph_module.graph.nodes if n.op == "call_module"]
    assert ug.unit_names == [n.name for n in calls]
    with pytest.raises(ValueError, match="granularity"):
        trace_units(model, x, granularity="layers")


def _assert_monotone(ug: UnitGraph) -> None:
    """Every data edge goes from a unit to the same or a later unit; every unit has nodes."""
    for node in ug.graph_module.graph.nodes:
        if node.op == "output":
            continue
        assert node.name in ug.node_unit
        for user in node.users:
            if user.op != "output":
                assert ug.node_unit[node.name] <= ug.node_unit[user.name], (node.name, user.name)
    assert all(ug.nodes_of(u) for u in range(ug.num_units))


def _split_matches(model: torch.nn.Module, x, ug: UnitGraph, num_stages: int) -> None:
    """Split the graph at contiguous unit boundaries and compare outputs bit for bit."""
    n = ug.num_units
    stage_of_unit = [min(num_stages - 1, u * num_stages // n) for u in range(n)]
    split = split_module(
        ug.graph_module, model, lambda node: stage_of_unit[ug.node_unit[node.name]]
    )
    stages = [name for name, _ in split.named_children() if name.startswith("submod_")]
    assert len(stages) == len(set(stage_of_unit))
    with torch.no_grad():
        reference = leaves(call_model(model, x))
        unsplit = leaves(call_model(ug.graph_module, x))
        got = leaves(ug.unflatten_output(split(*ug.flat_inputs(x))))
    assert len(got) == len(unsplit) == len(reference)
    for a, b, c in zip(got, unsplit, reference, strict=True):
        assert torch.equal(a, b)  # splitting changes nothing at all
        # The traced graph may take other kernels than eager (e.g. export decomposes the
        # fused multi-head-attention fast path), so it matches the model to rounding.
        torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("factory", [small_gpt, small_resnet, small_mlp])
@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("granularity", ["block", "node"])
def test_split_module_at_unit_boundaries_is_exact(factory, tracer, granularity) -> None:
    model, x = factory()
    model.eval()  # BatchNorm statistics must not move between the two runs
    ug = trace_units(model, x, granularity=granularity, tracer=tracer)
    _assert_monotone(ug)
    for stages in (2, 3):
        _split_matches(model, x, ug, stages)


def test_cut_tensors_count_skip_connections() -> None:
    model = SkipCNN()
    ug = trace_units(model, torch.randn(2, 3, 8, 8))
    assert ug.unit_names == ["stem", "body.0", "body.1", "body.2", "pool", "fc"]
    cuts = cut_tensors(ug)
    assert len(cuts) == ug.num_units - 1
    # The stem output is live across every cut up to the add before the pool.
    assert [len(c) for c in cuts] == [1, 2, 2, 2, 1]
    stem_out = cuts[0][0]
    assert all(stem_out in c for c in cuts[:4]) and stem_out not in cuts[4]


def test_cut_tensors_carry_mask_and_early_outputs() -> None:
    model = TiedDecoder(output="tuple")
    inputs = decoder_inputs(2)
    ug = trace_units(model, inputs)
    cuts = cut_tensors(ug)
    pad = next(n.name for n in ug.graph_module.graph.nodes if n.name.startswith("eq"))
    first_block = ug.unit_names.index("h.0")
    last_block = ug.unit_names.index("h.2")
    # The padding mask is computed with the first block (glue joins the next module) and is
    # live across every cut up to the last block; before that the raw mask input is.
    assert all(pad in cuts[i] for i in range(first_block, last_block))
    assert pad not in cuts[last_block] and pad not in cuts[first_block - 1]
    assert all("attention_mask" in cuts[i] for i in range(first_block))
    # The hidden state (an early output) leaves ln_f and must reach the end.
    assert cuts[-1] == [ug.unit_names[-2].replace(".", "_")]


def test_tracer_chain_fx_export_hooks_and_error() -> None:
    x = torch.randn(4, 8)
    assert trace_units(torch.nn.Sequential(torch.nn.Linear(8, 8)), x).tracer == "fx"
    assert trace_units(ShapeBranch(), x).tracer == "export"
    with pytest.warns(UserWarning, match="forward hooks"):
        ug = trace_units(GatedChain(), x)
    assert ug.tracer == "hooks" and ug.unit_names == ["inp", "gate", "out"]
    with pytest.raises(TraceError) as info:
        trace_units(DataBranch(), x)
    message = str(info.value)
    assert "\n" not in message
    assert (
        "torch.fx.symbolic_trace failed" in message
        and "torch.export(strict=False) failed" in message
    )
    with pytest.raises(TraceError, match="with fx"):
        trace_units(ShapeBranch(), x, tracer="fx")


def test_hooks_graph_splits_exactly() -> None:
    model = GatedChain()
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ug = trace_units(model, x)
    _split_matches(model, x, ug, 2)


def test_hooks_graph_expands_sequential_children_into_blocks() -> None:
    model = GatedStack()
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ug = trace_units(model, x)
        coarse = trace_units(model, x, granularity="node")
    assert ug.tracer == "hooks"
    assert ug.unit_names == ["inp", "layers.0", "layers.1", "layers.2", "out"]
    assert ug.unit_kinds == ["Linear", "Gate", "Gate", "Gate", "Linear"]
    assert len(coarse.unit_names) == 5
    _split_matches(model, x, ug, 3)


@pytest.mark.parametrize("output", ["dict", "tuple", "dataclass"])
@pytest.mark.parametrize("with_mask", [True, False])
def test_realistic_decoder_tied_kwargs_mask_flag(output, with_mask) -> None:
    model = TiedDecoder(output=output).eval()
    inputs = decoder_inputs(2)
    if not with_mask:
        inputs = {"input_ids": inputs["input_ids"]}
    ug = trace_units(model, inputs)
    assert ug.tracer == "fx"
    assert ug.unit_names == ["wte", "wpe", "h.0", "h.1", "h.2", "ln_f", "lm_head"]
    _assert_monotone(ug)
    _split_matches(model, inputs, ug, 3)
    model.cfg.use_final_norm = False  # the config flag changes the traced graph
    assert "ln_f" not in trace_units(model, inputs).unit_names


def test_export_flat_inputs_and_outputs_round_trip() -> None:
    model = TiedDecoder(output="dict").eval()
    inputs = decoder_inputs(2)
    ug = trace_units(model, inputs, tracer="export")
    assert ug.unit_names == ["wte", "wpe", "h.0", "h.1", "h.2", "ln_f", "lm_head"]
    _split_matches(model, inputs, ug, 4)


def test_one_block_list_beats_inner_sequential() -> None:
    """A ModuleList with one block is still the block list, not the block's inner Sequential."""
    model = TiedDecoder(DecoderConfig(layers=1))
    assert trace_units(model, decoder_inputs(2)).unit_names == [
        "wte",
        "wpe",
        "h.0",
        "ln_f",
        "lm_head",
    ]


class ReusedActivation(torch.nn.Module):
    """One activation module called after two layers, and a weight used functionally."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc2(self.act(self.fc1(x))))
        return self.out(h) + torch.nn.functional.linear(h, self.fc1.weight)


def test_reused_module_keeps_units_contiguous() -> None:
    model = ReusedActivation()
    x = torch.randn(4, 8)
    ug = trace_units(model, x)
    assert ug.unit_names == ["fc1", "act", "fc2", "out"]
    # The second call of `act` runs after fc2, so it belongs to fc2's unit, not to `act`.
    second_act = [n for n in ug.graph_module.graph.nodes if n.target == "act"][1]
    assert ug.node_unit[second_act.name] == ug.unit_names.index("fc2")
    _assert_monotone(ug)
    for stages in (2, 3, 4):
        _split_matches(model, x, ug, stages)


def test_tuple_output_unpacking_stays_with_its_unit() -> None:
    model = LSTMTagger()
    x = torch.randint(0, 50, (4, 7))
    ug = trace_units(model, x)
    assert ug.unit_names == ["emb", "lstm", "head"]
    lstm_cut = cut_tensors(ug)[1]
    # Only the last step's output crosses, not the (out, (h, c)) tuple.
    assert len(lstm_cut) == 1 and lstm_cut[0] != "lstm"
    _split_matches(model.eval(), x, ug, 3)
