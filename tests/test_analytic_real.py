"""Analytic mode on real architectures (issues 10 and 13): repeated blocks counted once,
MoE experts counted, attention the fused kernels do not take, meta failures in one line,
and the training state charged per parameter."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only, nothing downloads

import json
from pathlib import Path

import pytest
import torch
from autopipe.profiler.analytic import AnalyticProfileError, profile_analytic
from autopipe.profiler.calibrate import reprice
from autopipe.profiler.options import AnalyticOptions
from profiler_models import load_example
from torch import nn

from autopipe.cli import main
from autopipe.core.catalog import get_device
from autopipe.core.profile import Profile

FIELDS = (
    "name", "kind", "forward_s", "backward_s", "forward_overhead_s", "backward_overhead_s",
    "parameter_count", "parameter_bytes", "gradient_bytes", "optimizer_bytes", "buffer_bytes",
    "activation_bytes", "output_bytes", "peak_bytes", "forward_flops", "backward_flops",
    "shared_parameters",
)  # fmt: skip


def assert_same_counts(full: Profile, short: Profile) -> None:
    assert full.unit_names == short.unit_names
    for a, b in zip(full.units, short.units, strict=True):
        for f in FIELDS:
            va, vb = getattr(a, f), getattr(b, f)
            if isinstance(va, float):
                assert va == pytest.approx(vb, rel=1e-12), (a.name, f)
            else:
                assert va == vb, (a.name, f)
    assert full.cut_bytes == short.cut_bytes
    assert full.parameter_bytes_total == short.parameter_bytes_total
    assert full.input_bytes == short.input_bytes


def tiny_mixtral(layers: int = 5):  # noqa: ANN201
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, use_cache=False, max_position_embeddings=64,
    )  # fmt: skip
    return cfg, lambda: transformers.MixtralForCausalLM(cfg)


def test_repeated_blocks_counted_once_equal_the_full_count() -> None:
    """GPT (fx) and Mixtral with a padding mask (export): counting 3 blocks and repeating
    them gives every field of counting all blocks, re-priced for another GPU too."""
    gpt = load_example("gpt")
    cfg = gpt.GPTConfig(vocab_size=512, n_layer=5, d_model=64, seq_len=16)
    x = gpt.example_inputs(4, cfg)
    kw = {"loss_fn": gpt.loss_fn}
    full = profile_analytic(
        lambda: gpt.build_model(**vars(cfg)), x, "a100-80gb", AnalyticOptions(share=False), **kw
    )
    short = profile_analytic(lambda: gpt.build_model(**vars(cfg)), x, "a100-80gb", **kw)
    assert short.counted_blocks is not None and dataclasses.asdict(short.counted_blocks) == {
        "container": "blocks", "blocks": 5, "counted": 3, "head": 0, "period": 1,
    }  # fmt: skip
    assert [u.measured_as for u in short.units[3:8]] == ["", "", "blocks.1", "blocks.1", "blocks.2"]
    assert_same_counts(full, short)
    h100 = get_device("h100")
    assert_same_counts(reprice(full, h100), reprice(short, h100))

    _, build = tiny_mixtral(layers=4)
    ids = torch.randint(0, 128, (2, 16))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    full = profile_analytic(build, inputs, "h100", AnalyticOptions(share=False))
    short = profile_analytic(build, inputs, "h100")
    assert short.counted_blocks.counted == 3 and short.tracer == "export"
    assert_same_counts(full, short)


def test_moe_expert_flops_equal_a_hand_count() -> None:
    """A Mixtral layer's forward FLOPs: attention projections, attention, router and the
    experts under top-k routing (every token through k experts), as by hand; bf16 runs
    aten._grouped_mm, fp32 Hugging Face's grouped-matmul fallback op."""
    cfg, build = tiny_mixtral(layers=1)
    batch, seq = 2, 16
    t = batch * seq
    h, ffn, heads, kv = cfg.hidden_size, cfg.intermediate_size, 4, 2
    head_dim = h // heads
    attention = 2 * t * h * (heads * head_dim) * 2 + 2 * t * h * (kv * head_dim) * 2
    attention += 4 * batch * heads * seq * seq * head_dim  # q k^T and weights x v
    router = 2 * t * h * cfg.num_local_experts
    experts = t * cfg.num_experts_per_tok * (2 * h * 2 * ffn + 2 * ffn * h)
    ids = {"input_ids": torch.zeros(batch, seq, dtype=torch.long)}
    for dtype in ("bfloat16", "float32"):
        p = profile_analytic(build, ids, "h100", AnalyticOptions(dtype=dtype, microbatch_sizes=()))
        layer = p.units[p.unit_names.index("model.layers.0")]
        assert layer.forward_flops == attention + router + experts, dtype
        # backward: twice every matmul (input and weight gradients), attention 2.5x
        assert layer.backward_flops >= 2 * (attention + router + experts) - 4 * router


def test_attention_the_fused_kernel_does_not_take_is_counted_as_math() -> None:
    """A value head size unlike the query's (multi-head latent attention) has no fused
    kernel: it is counted as the math decomposition, q k^T and weights x v."""

    class Latent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(64, 64)
            self.v = nn.Linear(64, 96)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q = self.q(x).view(b, s, 4, 16).transpose(1, 2)
            v = self.v(x).view(b, s, 4, 24).transpose(1, 2)
            return torch.nn.functional.scaled_dot_product_attention(q, q, v, attn_mask=mask)

    x, mask = torch.randn(2, 32, 64), torch.ones(2, 1, 32, 32, dtype=torch.bool)
    p = profile_analytic(
        Latent(), (x, mask), "h100", AnalyticOptions(granularity="node", microbatch_sizes=())
    )
    sdpa = next(u for u in p.units if "scaled_dot_product" in u.name)
    assert sdpa.forward_flops == 2 * 2 * 4 * 32 * 32 * (16 + 24)
    # the math decomposition saves the (2, 4, 32, 32) attention weights
    assert sdpa.activation_bytes >= 2 * 4 * 32 * 32 * 2


def test_an_op_that_fails_on_meta_is_one_line_naming_analytic_mode() -> None:
    class Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.a(x)
            return self.b(x * x.norm().item())

    with pytest.raises(AnalyticProfileError) as info:
        profile_analytic(Scalar(), torch.randn(4, 8), "h100")
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert "analytic mode" in message and "meta device" in message
    assert "b failed there in forward" in message and "item()" in message


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict | str]:
    code = main(["plan", *args, "-q", "--json"])
    out, err = capsys.readouterr()
    if code:
        return code, err.strip()
    data = json.loads(out)
    report = data.pop("report")
    stages = [{**s, **r} for s, r in zip(data["stages"], report.pop("stages"), strict=True)]
    return code, {**data, **report, "stages": stages}  # the plan and its report's figures


def test_llama2_70b_on_16_h100_fits_only_without_mixed_adam(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bf16 training defaults to mixed-precision Adam (16 B/parameter: 2 weight, 2 gradient,
    12 fp32 master, m, v): 69 B parameters do not fit 16 x H100-80GB. Plain bf16 Adam
    (8 B) does; the plan says which it charged."""
    pytest.importorskip("transformers")
    hf = Path(__file__).resolve().parents[1] / "benchmarks" / "models" / "hf_llama.py"
    import importlib.util

    spec = importlib.util.spec_from_file_location("_hf_llama", hf)
    assert spec is not None and spec.loader is not None
    llama = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(llama)
    p = profile_analytic(
        llama.llama2_70b, llama.example_inputs(8), "h100", AnalyticOptions(microbatch_sizes=())
    )
    assert sum(u.parameter_count for u in p.units) == pytest.approx(69e9, rel=0.01)
    assert (
        p.optimizer == "mixed-adam"
        and p.counted_blocks is not None
        and p.counted_blocks.blocks == 80
    )
    path = tmp_path / "llama70b.json"
    p.save(path)
    flags = ("--gpus", "16", "--device", "h100", "--checkpoint", "auto")

    code, err = _plan(capsys, str(path), *flags)
    assert code == 1 and "no 16-stage plan fits" in err
    code, err = _plan(capsys, str(path), *flags, "--optimizer", "mixed-adam")
    assert code == 1
    code, plan = _plan(capsys, str(path), *flags, "--optimizer", "adam")
    assert code == 0 and (plan["optimizer"], plan["state_bytes_per_parameter"]) == ("adam", 8.0)
    largest = max(s["parameter_bytes"] + s["optimizer_bytes"] for s in plan["stages"])
    assert largest < 80e9 / 1.1
    code, plan = _plan(capsys, str(path), *flags, "--bytes-per-parameter", "10")
    assert code == 0 and (plan["optimizer"], plan["state_bytes_per_parameter"]) == ("custom", 10)
    # An old profile (no record of a choice, optimizer "adam") is planned with the default too.
    old = json.loads(path.read_text())
    old["optimizer"] = "adam"
    del old["optimizer_chosen"]
    path.write_text(json.dumps(old))
    code, err = _plan(capsys, str(path), *flags)
    assert code == 1 and "no 16-stage plan fits" in err


def test_profile_records_an_explicit_optimizer_for_the_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpt = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
    out = tmp_path / "p.json"
    assert (
        main(["profile", gpt, "--device", "a100-80gb", "--optimizer", "sgd", "-q", "-o", str(out)])
        == 0
    )
    profile = Profile.load(out)
    assert profile.optimizer == "sgd" and profile.optimizer_chosen is True
    block = profile.units[profile.unit_names.index("blocks.0")]
    assert block.optimizer_bytes == 0 and block.gradient_bytes == block.parameter_bytes
    code, plan = _plan(capsys, str(out), "--gpus", "2")
    assert code == 0 and (plan["optimizer"], plan["state_bytes_per_parameter"]) == ("sgd", 4.0)
    capsys.readouterr()
    assert main(["plan", str(out), "--gpus", "2", "--meta-init"]) == 2
    assert "--meta-init applies only when profiling" in capsys.readouterr().err
