"""The profile's TP fields from the model's TP plan (Hugging Face's own, or a tp_plan())."""

from __future__ import annotations

import pytest
import torch
from autopipe.profiler.tensor_parallel import (
    NO_PLAN_NOTE,
    annotate_tensor_parallel,
    model_tp_plan,
    tied_placements,
    tied_split,
)
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from autopipe.core.profile import Profile, UnitProfile

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 64, 96, 8, 4, 100


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
        use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def llama_profile(model: nn.Module) -> Profile:
    """Units as the tracer names them, with their parameter counts; outputs of 1000 bytes."""
    names = ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1",
             "model.norm", "lm_head"]  # fmt: skip
    modules = dict(model.named_modules())
    units = [
        UnitProfile(
            name=n, forward_s=1e-3, output_bytes=1000,
            parameter_count=sum(p.numel() for p in modules[n].parameters()),
        )
        for n in names
    ]  # fmt: skip
    return Profile(units=units, cut_bytes=[700] * 5, batch_size=2, input_bytes=50)


def test_hugging_face_plan_is_mapped_onto_units() -> None:
    model = tiny_llama()
    p = annotate_tensor_parallel(llama_profile(model), model)
    # The vocab-parallel embedding is split too (autopipe run splits it with torch's
    # RowwiseParallel): the whole plan is kept, and nothing is left out.
    assert model_tp_plan(model)["model.embed_tokens"] == "embedding_rowwise"
    assert p.tp_plan == model_tp_plan(model)
    assert p.tp_note == ""
    assert "model.layers.*.self_attn.q_proj" in p.tp_plan  # under the base model's prefix
    by = {u.name: u for u in p.units}
    head_dim = HIDDEN // HEADS
    attention = HIDDEN * HIDDEN * 2 + 2 * HIDDEN * KV_HEADS * head_dim  # q, o; k, v
    mlp = 3 * HIDDEN * FFN
    block = by["model.layers.0"]
    assert block.tp_parameter_count == attention + mlp  # every linear; not the two norms
    assert block.parameter_count == attention + mlp + 2 * HIDDEN
    assert block.tp_compute_fraction == (attention + mlp) / block.parameter_count
    assert block.tp_collective_bytes == 2 * 1000  # o_proj and down_proj close two regions
    assert block.tp_rowwise_output_bytes == 2 * 1000  # both reduce-scattered from a matmul
    # the vocab-parallel embedding ends a region (its output reduce-scattered); the
    # column-wise head gathers its input
    assert by["model.embed_tokens"].tp_collective_bytes == 1000 // 2  # RS fwd, AG bwd
    assert by["model.embed_tokens"].tp_parameter_count == VOCAB * HIDDEN
    assert by["model.embed_tokens"].tp_compute_fraction == 1.0
    # its input gathered (fwd) and reduce-scattered (bwd), and its logits gathered (fwd)
    assert by["lm_head"].tp_collective_bytes == (2 * 700 + 1000) // 4
    assert by["lm_head"].tp_rowwise_output_bytes == 0  # no reduce-scatter in its forward
    assert by["model.embed_tokens"].tp_rowwise_output_bytes == 0  # its RS follows no matmul
    # the gathered logits, which loss parallelism leaves sharded; no other unit gathers
    assert by["lm_head"].tp_gathered_output_bytes == 1000
    assert [u.name for u in p.units if u.tp_gathered_output_bytes] == ["lm_head"]
    assert by["lm_head"].tp_compute_fraction == 1.0
    assert (
        by["model.norm"].tp_parameter_count == 0 and by["model.rotary_emb"].tp_compute_fraction == 0
    )
    assert p.tp_degrees == [2, 4]  # divides 8 heads and 4 key/value heads


def tiny_llama_of(vocab: int, tie: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=vocab,
        use_cache=False, tie_word_embeddings=tie,
    )  # fmt: skip
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def test_an_embedding_that_cannot_be_split_is_priced_whole() -> None:
    """A vocab-parallel embedding whose vocabulary a T the heads allow does not divide is
    left whole (and priced so), and the note says why."""
    model = tiny_llama_of(102, tie=False)
    p = annotate_tensor_parallel(llama_profile(model), model)
    assert "model.embed_tokens" not in p.tp_plan and "lm_head" in p.tp_plan
    assert "model.embed_tokens (embedding_rowwise" in p.tp_note and "102" in p.tp_note
    assert {u.name: u for u in p.units}["model.embed_tokens"].tp_parameter_count == 0


def test_a_tied_head_and_embedding_are_split_alike_vocab_parallel() -> None:
    """A head tied to the embedding: the plan splits both by vocabulary rows (the embedding
    ``embedding_rowwise``, the head ``colwise_gather_output``: one ``[V, H]`` weight sharded
    ``Shard(0)`` in both), so the tie holds and T > 1 is offered. This profile once offered no
    T > 1 at all (the mesh zoo's tied families were refused on every TP mesh)."""
    model = tiny_llama_of(VOCAB, tie=True)
    p = annotate_tensor_parallel(llama_profile(model), model)
    assert p.tp_plan["lm_head"] == "colwise_gather_output"
    assert p.tp_plan["model.embed_tokens"] == "embedding_rowwise"
    assert (p.tp_degrees, p.tp_note) == ([2, 4], "")
    by = {u.name: u for u in p.units}
    assert by["lm_head"].tp_parameter_count == by["model.embed_tokens"].tp_parameter_count
    assert by["lm_head"].tp_parameter_count == VOCAB * HIDDEN
    assert tied_placements(model, p.tp_plan) == {
        "model.embed_tokens": {"model.embed_tokens": "rows", "lm_head": "rows"}
    }
    assert tied_split(model, p.tp_plan) == ""


def test_a_tie_the_plan_would_tear_is_split_in_neither() -> None:
    """A plan that splits the tied head and not the embedding (or an embedding left whole
    for its vocabulary) would untie them, and the two would train apart: the head is left
    whole too, with the reason in the note, and the rest of the plan still splits."""
    model = tiny_llama_of(VOCAB, tie=True)
    plan = {k: v for k, v in model_tp_plan(model).items() if k != "model.embed_tokens"}
    p = annotate_tensor_parallel(llama_profile(model), model, plan)
    assert "lm_head" not in p.tp_plan and "model.layers.*.mlp.up_proj" in p.tp_plan
    assert p.tp_degrees == [2, 4]
    assert "lm_head (colwise_gather_output: its weight is tied to model.embed_tokens" in p.tp_note
    assert {u.name: u for u in p.units}["lm_head"].tp_parameter_count == 0
    # what the runtime says of that plan made by hand, in one line
    why = tied_split(model, model_tp_plan(model) | {"model.embed_tokens": "rowwise"})
    assert "splits model.embed_tokens (rowwise) but its weight is tied to lm_head" in why
    assert "(model.embed_tokens rowwise, lm_head rows)" in why and "\n" not in why
    torn = {k: v for k, v in model_tp_plan(model).items() if k != "model.embed_tokens"}
    assert "(model.embed_tokens whole, lm_head rows)" in tied_split(model, torn)
    # the vocabulary 102 is not split 4 ways: the embedding stays whole, and so the head
    odd = tiny_llama_of(102, tie=True)
    q = annotate_tensor_parallel(llama_profile(odd), odd)
    assert "lm_head" not in q.tp_plan and "model.embed_tokens" not in q.tp_plan
    assert (
        "vocabulary 102" in q.tp_note and "lm_head (colwise_gather_output: its weight" in q.tp_note
    )


def test_a_model_without_a_plan_gets_t1_and_a_note() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    units = [UnitProfile(name=n, forward_s=1e-3, parameter_count=72) for n in ("0", "1", "2")]
    p = annotate_tensor_parallel(Profile(units=units, cut_bytes=[64, 64], batch_size=4), model)
    assert (p.tp_plan, p.tp_degrees, p.tp_note) == ({}, [], NO_PLAN_NOTE)
    assert all(u.tp_parameter_count == 0 for u in p.units)


def test_a_model_files_tp_plan_wins() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    units = [
        UnitProfile(name="0", forward_s=1e-3, parameter_count=8 * 16 + 16, output_bytes=64),
        UnitProfile(name="1", forward_s=1e-3),
        UnitProfile(name="2", forward_s=1e-3, parameter_count=16 * 8 + 8, output_bytes=32),
    ]
    p = Profile(units=units, cut_bytes=[64, 64], batch_size=4, input_bytes=32)
    annotate_tensor_parallel(p, model, lambda: {"0": "colwise", "2": "rowwise"})
    assert [u.tp_parameter_count for u in p.units] == [8 * 16 + 16, 0, 16 * 8]  # row bias kept
    # unit 0 gathers its input (fwd) and reduce-scatters its gradient (bwd): 2 x 32 of 4 C
    assert [u.tp_collective_bytes for u in p.units] == [16, 0, 32]
    assert p.tp_degrees == [2, 4, 8, 16]  # no heads: the split dimensions (16 and 16)


def test_both_profilers_fill_the_fields(tmp_path: object) -> None:
    from autopipe.profiler.analytic import profile_analytic
    from autopipe.profiler.measure import profile as measure
    from autopipe.profiler.options import AnalyticOptions, MeasureOptions

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    plan = {"0": "colwise", "2": "rowwise"}
    x = torch.randn(4, 8)
    counted = profile_analytic(build, x, "h100", AnalyticOptions(dtype="float32"), tp_plan=plan)
    options = MeasureOptions(microbatch_sizes=())
    measured = measure(build(), x, options, progress=False, tp_plan=plan)
    for p in (counted, measured):
        assert p.tp_plan == plan
        split = {u.name: u.tp_parameter_count for u in p.units}
        assert split.get("0") == 8 * 16 + 16 and split.get("2") == 16 * 8


def test_the_profiles_plan_is_what_autopipe_run_splits() -> None:
    """A planned TP plan must run: every kept entry is a style the runtime maps, on modules
    it can split at T = 2 (the HF Llama plan's vocab-parallel embedding once made every
    planned Llama TP run fail at start-up; the runtime now splits it)."""
    from autopipe.runtime.distributed.mesh import planned_modules

    model = tiny_llama()
    p = annotate_tensor_parallel(llama_profile(model), model)
    split = planned_modules(model, p.tp_plan, 2)
    assert split["model.embed_tokens"] == "embedding_rowwise"
    assert split["model.layers.1.mlp.down_proj"] == "rowwise" and split["lm_head"]


def test_a_star_is_one_path_part() -> None:
    """Hugging Face's pattern rule, shared by the profiler and the runtime."""
    from autopipe.profiler.tensor_parallel import tp_pattern

    assert tp_pattern("layers.*.mlp").fullmatch("layers.3.mlp")
    assert not tp_pattern("layers.*.mlp").fullmatch("layers.3.inner.mlp")
    assert not tp_pattern("*").fullmatch("a.b")


BATCH, SEQ = 2, 16


def _profiled_llama() -> Profile:
    """The counting profiler's profile of a tiny Llama (fp32, 2 samples of 16 tokens)."""
    from autopipe.profiler.analytic import profile_analytic
    from autopipe.profiler.options import AnalyticOptions

    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    return profile_analytic(
        lambda: LlamaForCausalLM(tiny_llama().config),
        {"input_ids": ids, "labels": ids},
        "h100",
        AnalyticOptions(dtype="float32", microbatch_sizes=()),
    )


def test_the_profile_is_laid_out_as_autopipe_run_lays_out_tp() -> None:
    """autopipe run shards the activations between TP regions over dim 1 (``[b, s / T, h]``)
    and gathers each norm's output once for the column-wise modules it feeds, which save it
    whole: a block saves two gathered ``[b, s, h]`` inputs (q/k/v's, gate/up's), the head
    one; units without a column-wise module none. Before, both fields stayed 0."""
    from autopipe.core.vocabulary import SEQUENCE_DIM

    p = _profiled_llama()
    by = {u.name: u for u in p.units}
    hidden_bytes = BATCH * SEQ * HIDDEN * 4  # fp32 [b, s, h]
    assert SEQUENCE_DIM == 1
    for name in ("model.layers.0", "model.layers.1"):
        assert by[name].tp_sequence_dim == SEQUENCE_DIM
        assert by[name].tp_gathered_input_bytes == 2 * hidden_bytes == 16384
    assert by["lm_head"].tp_gathered_input_bytes == hidden_bytes
    assert by["lm_head"].tp_sequence_dim == by["model.embed_tokens"].tp_sequence_dim == 1
    assert by["model.embed_tokens"].tp_gathered_input_bytes == 0  # no column-wise module
    assert by["model.norm"].tp_sequence_dim == by["model.norm"].tp_gathered_input_bytes == 0


def test_a_tp2_plan_of_it_prices_the_relayout_and_the_gathered_inputs() -> None:
    """At T = 2 on 3.35 TB/s a block's device share adds the chunk + cat copy of its
    collectives (2 x 2 C bytes read and written per pass) and keeps its two gathered inputs
    whole: (A - g) / 2 + g saved bytes instead of A / 2."""
    import dataclasses

    from autopipe.planner.mesh_costs import Topology, device_profile, sequence_relayout_s

    top = Topology(8, 400e9, 50e9, memory_bytes_per_s=3.35e12)
    p = _profiled_llama()
    old = dataclasses.replace(
        p,
        units=[
            dataclasses.replace(u, tp_sequence_dim=0, tp_gathered_input_bytes=0) for u in p.units
        ],
    )
    i = p.unit_names.index("model.layers.0")
    block, was = device_profile(p, 2, top).units[i], device_profile(old, 2, top).units[i]
    u = p.units[i]
    relayout = sequence_relayout_s(2 * u.tp_collective_bytes, u, 2, top)
    assert relayout == pytest.approx(2 * 2 * 16384 / 3.35e12) and relayout > 0
    assert block.forward_s == pytest.approx(was.forward_s + relayout)
    assert block.backward_s == pytest.approx(was.backward_s + relayout)
    g = u.tp_gathered_input_bytes
    assert block.activation_bytes == (u.activation_bytes - g) // 2 + g
    assert block.activation_bytes > was.activation_bytes == u.activation_bytes // 2
