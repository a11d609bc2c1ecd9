"""Sequence parallelism's layout, read off the traced graph (runtime/distributed/sequence_parallel.py).

No process group: the layout of the two mesh-test models (tests/mesh_models.py) as the
distributed runtime computes it, the norm call a torch.export graph gets back (and the values
it computes, unchanged), and the one-line refusals. The 4-process runs that train with it
are tests/test_distributed_mesh.py's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx, nn

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mesh_models  # noqa: E402

T = 2


def planned_layout(name: str, tp_plan: dict[str, str] | None = None) -> tuple[Any, Any, Any]:
    """(layout, the TP-rank-shaped PlannedStages, the plan) of mesh model ``name`` cut in two
    stages, as DistributedPipeline computes them."""
    from autopipe.runtime.distributed.mesh import local_shapes, planned_modules
    from autopipe.runtime.distributed.pipeline import planned_sequence_layout
    from autopipe.runtime.planned_stages import partition
    from test_distributed_mesh import mesh_plan

    plan = mesh_plan(name, "pp2tp2")
    model = getattr(mesh_models, name)()
    inputs = getattr(mesh_models, f"example_inputs_{name}")(4)
    split = planned_modules(model, tp_plan or plan.tp_plan, T)
    with local_shapes(model, split, T):
        planned = partition(model, inputs, plan, check_parameters=False)
    return planned_sequence_layout(planned, model, split, inputs, plan), planned, plan


def test_gpt_norms_and_residual_are_read_off_the_graph() -> None:
    layout, planned, _ = planned_layout("gpt")
    norms = {f"blocks.{i}.ln_{j}" for i in range(2) for j in (1, 2)} | {"ln_f"}
    assert set(layout.norms) == norms  # each norm that feeds a column-wise linear
    assert set(layout.colwise_inputs.values()) == {"norm"}
    # The embeddings' dropout output is replicated: it is sharded where it is produced.
    assert layout.transitions == {"drop": 1}
    (cut,) = planned.stages[0].output_names  # the residual between the two blocks
    assert layout.sharded[cut] == 1
    assert layout.local_shape(cut, [2, mesh_models.SEQ, 32]) == [2, mesh_models.SEQ // T, 32]


def test_a_vocab_parallel_embedding_shards_the_position_embeddings_instead() -> None:
    """GPT's ``tok_emb(idx) + pos_emb(arange)``: with the token embedding split by vocabulary
    (its output reduce-scattered over the sequence), the position embeddings ([s, h]) are
    sharded along their dim 0, the sequence, where the add broadcasts them."""
    plan = {**mesh_models.tp_plan_of("gpt"), "tok_emb": "embedding_rowwise"}
    layout, _, _ = planned_layout("gpt", plan)
    assert layout.transitions == {"pos_emb": 0}
    assert layout.sharded["tok_emb"] == 1 and layout.sharded["add"] == 1


def test_llama_norms_are_found_in_a_torch_export_graph() -> None:
    layout, _, _ = planned_layout("llama")
    want = {f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm",
            "post_attention_layernorm")} | {"model.norm"}  # fmt: skip
    assert set(layout.norms) == want
    # The head reads the final norm through the whole-range slice of logits_to_keep.
    assert layout.colwise_inputs["lm_head"] == "norm" and layout.gathered
    assert layout.transitions == {}  # the vocab-parallel embedding's output is sharded already
    base = {k: v for k, v in mesh_models.tp_plan_of("llama").items() if "embed" not in k}
    whole, _, _ = planned_layout("llama", base)
    assert whole.transitions == {"embedding": 1}  # a whole embedding is sharded after


def test_a_norm_call_computes_what_the_inlined_ops_did() -> None:
    """call_norm_modules turns a torch.export graph's inlined RMSNorm ops back into a call
    of the model's own module: the stage's outputs are unchanged."""
    from autopipe.runtime.distributed.mesh import adopt_modules
    from autopipe.runtime.distributed.sequence_parallel import call_norm_modules
    from autopipe.runtime.planned_stages import partition

    layout, _, plan = planned_layout("llama")
    model = mesh_models.llama()
    inputs = mesh_models.example_inputs_llama(4)
    planned = partition(model, inputs, plan)
    body = planned.stages[1].module
    adopt_modules(body, model, layout.norms)
    received = planned.stages[0].module(*planned.binder.flat(inputs))
    before = body(*received)
    held = call_norm_modules(body, layout.norms)
    assert sorted(held) == ["model.layers.1.input_layernorm",
                            "model.layers.1.post_attention_layernorm", "model.norm"]  # fmt: skip
    calls = [n.target for n in body.graph.nodes if n.op == "call_module"]
    assert sorted(calls) == sorted(held)
    assert not any(n.target is torch.ops.aten.rsqrt.default for n in body.graph.nodes)
    after = body(*received)
    for a, b in zip(before, after, strict=True):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


class Mixer(nn.Module):
    """A "norm" with a weight that is not position-wise: a running mean over the sequence."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        return self.weight * x.cumsum(1) / steps


class Toy(nn.Module):
    """Embedding, one norm -> column-wise -> row-wise region, and a final norm and head."""

    def __init__(self, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.norm, self.final = norm(8), norm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        x = x + self.down(self.up(self.norm(x)))
        return self.head(self.final(x))


class LeafTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, Mixer) or super().is_leaf_module(m, qualname)


def toy_layout(norm: Callable[[int], nn.Module], seq: int, tp_plan: dict[str, str]) -> Any:
    from autopipe.runtime.distributed.sequence_parallel import sequence_layout

    torch.manual_seed(0)
    model = Toy(norm)
    graph_module = fx.GraphModule(model, LeafTracer().trace(model))
    values: dict[str, Any] = {}

    class Record(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            values[n.name] = super().run_node(n)
            return values[n.name]

    Record(graph_module).run(torch.randint(0, 16, (2, seq)))
    return sequence_layout(graph_module, model, tp_plan, values, T)


def test_refusals_are_one_line() -> None:
    from autopipe.runtime.distributed.sequence_parallel import SequenceParallelError

    plan = {"up": "colwise", "down": "rowwise", "head": "colwise_rep"}
    layout = toy_layout(nn.LayerNorm, 6, plan)  # runs with LayerNorms
    assert set(layout.norms) == {"norm", "final"} and layout.transitions == {"emb": 1}
    cases = [
        (Mixer, 6, plan, "does not treat sequence positions independently"),
        (nn.LayerNorm, 5, plan, "not divisible by tensor-parallel degree 2"),
    ]
    for norm, seq, tp, words in cases:
        with pytest.raises(SequenceParallelError, match=words) as exc:
            toy_layout(norm, seq, tp)
        assert "\n" not in str(exc.value)


def test_an_op_that_needs_the_whole_sequence_reads_the_shard_gathered() -> None:
    """Without the split head, the final norm feeds no column-wise module: it runs on the
    shard (SequenceParallel, its output kept a shard), and the head, which no plan splits
    and so runs whole on every rank, reads that shard gathered."""
    layout = toy_layout(nn.LayerNorm, 6, {"up": "colwise", "down": "rowwise"})
    assert set(layout.norms) == {"norm", "final"}
    assert layout.kept_sharded == {"final"}
    assert layout.gathers == {"head": {"final": 1}}
    assert "head" not in layout.sharded and layout.sharded["final"] == 1


class Sandwich(Toy):
    """Gemma-2 / GLM-4's sandwich: a norm on the row-wise module's output, before the add."""

    def __init__(self, norm: Callable[[int], nn.Module]) -> None:
        super().__init__(norm)
        self.post = norm(8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        x = x + self.post(self.down(self.up(self.norm(x))))
        return self.head(self.final(x))


def test_a_sandwich_norm_runs_on_the_shard() -> None:
    """The norm after the row-wise ``down`` feeds no split module: it is a norm on the shard
    (kept a shard), nothing is gathered for it, and the add reads two shards."""
    from autopipe.runtime.distributed.sequence_parallel import sequence_layout

    torch.manual_seed(0)
    model = Sandwich(nn.LayerNorm)
    graph_module = fx.GraphModule(model, LeafTracer().trace(model))
    values: dict[str, Any] = {}

    class Record(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            values[n.name] = super().run_node(n)
            return values[n.name]

    Record(graph_module).run(torch.randint(0, 16, (2, 6)))
    plan = {"up": "colwise", "down": "rowwise", "head": "colwise_rep"}
    layout = sequence_layout(graph_module, model, plan, values, T)
    assert set(layout.norms) == {"norm", "post", "final"}
    assert layout.kept_sharded == {"post"} and layout.gathers == {}
    assert layout.sharded["post"] == 1 and layout.sharded["add"] == 1
    assert layout.colwise_inputs == {"up": "norm", "head": "norm"}


def zoo_layout(family: str) -> tuple[Any, Any, dict[str, str]]:
    """(layout, the TP-rank-shaped PlannedStages, the split modules) of a mesh-zoo family
    (tests/mesh_zoo_models.py) as one stage at T = 2, as DistributedPipeline computes them."""
    import mesh_zoo_models
    from autopipe.profiler.analytic import profile_analytic
    from autopipe.runtime.distributed.mesh import local_shapes, planned_modules
    from autopipe.runtime.distributed.pipeline import planned_sequence_layout
    from autopipe.runtime.planned_stages import partition

    from autopipe.core.plan import Plan, StagePlan

    model = mesh_zoo_models.build(family)
    inputs = mesh_zoo_models.example_inputs(family, 4)
    profile = profile_analytic(model, inputs, "a100-80gb")
    plan = Plan(
        num_stages=1,
        microbatches=1,
        microbatch_size=4,
        batch_size=4,
        stages=[StagePlan(index=0, device="cpu", units=profile.unit_names)],
        granularity=profile.granularity,
        tensor_parallel=T,
        tp_plan=dict(profile.tp_plan),
    )
    split = planned_modules(model, plan.tp_plan, T)
    with local_shapes(model, split, T):
        planned = partition(model, inputs, plan, check_parameters=False)
    return planned_sequence_layout(planned, model, split, inputs, plan), planned, split


def test_mixture_of_experts_runs_on_each_ranks_tokens() -> None:
    """Mixtral (tests/mesh_zoo_models.py): the norm before each mixture-of-experts block
    runs on the shard, and the block, whose router and experts no plan splits, runs on each
    rank's share of the tokens as it is (it routes each token on its own), nothing gathered;
    its parameters' gradients are one rank's part, summed over the TP group."""
    from autopipe.runtime.distributed.tp_gradients import partial_gradient_parameters

    layout, planned, split = zoo_layout("mixtral")
    assert layout.kept_sharded == {f"model.layers.{i}.post_attention_layernorm" for i in range(2)}
    assert sorted(layout.token_modules) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert layout.gathers == {}
    for out in layout.token_modules.values():
        assert layout.sharded[out] == 1
    assert len(layout.transitions) == 2  # each attention's rotary cos / sin, as Llama's
    partial = partial_gradient_parameters(planned.graph_module, split, layout)
    names = {n for n, _ in planned.graph_module.named_parameters() if ".mlp." in n}
    assert names and set(partial) == names


def test_mla_shared_rotary_key_has_its_gradient_summed_over_tp() -> None:
    """DeepSeek-V3's MLA: the input norm's output is gathered for the low-rank projections
    no plan splits; the rotary key computed from it (one for all heads) is copied into each
    rank's heads, so its gradient is summed over the TP group there (one sum per layer), and
    no parameter is left with a partial gradient."""
    from autopipe.runtime.distributed.tp_gradients import partial_gradient_parameters

    layout, planned, split = zoo_layout("deepseek_v3")
    assert "model.layers.0.input_layernorm" in layout.kept_sharded
    assert layout.gradient_sums == {}  # filled by the gradient analysis
    partial = partial_gradient_parameters(planned.graph_module, split, layout)
    assert partial == {}
    graph = {n.name: n for n in planned.graph_module.graph.nodes}
    assert len(layout.gradient_sums) == 2  # layers 0 and 1
    for op, values in layout.gradient_sums.items():
        assert graph[op].target is torch.ops.aten.copy_.default and len(values) == 1
        assert "self_attn" in str(list(graph[op].meta["nn_module_stack"].values())[-1][0])


def test_a_norm_without_parameters_is_a_norm_too() -> None:
    """OLMo's LayerNorm has no weight: it is found by what it feeds, not by its parameters."""
    plan = {"up": "colwise", "down": "rowwise", "head": "colwise_rep"}
    layout = toy_layout(lambda width: nn.LayerNorm(width, elementwise_affine=False), 6, plan)
    assert set(layout.norms) == {"norm", "final"}


def test_a_post_norm_output_stays_a_shard() -> None:
    """Post-norm blocks: a norm's output feeds the next block's split ``up`` and its
    residual add, so it stays a local shard (``up`` gathers it); the last norm feeds only
    the head, so it is gathered once, as a pre-norm model's."""
    layout, planned, _ = planned_layout("postnorm")
    assert set(layout.norms) == {"blocks.0.norm", "blocks.1.norm"}
    assert layout.kept_sharded == {"blocks.0.norm"}
    assert layout.colwise_inputs == {"blocks.0.up": "sharded", "blocks.1.up": "sharded",
                                     "head": "norm"}  # fmt: skip
    assert layout.transitions == {"emb": 1}  # the embedding's output feeds up and the add
    (cut,) = planned.stages[0].output_names
    assert layout.sharded[cut] == 1  # the kept-sharded norm's output crosses the cut
