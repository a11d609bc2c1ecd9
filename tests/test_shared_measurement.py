"""Identical units measured once (issue 13): sharing, stable plans under clock noise, and
models measured one unit at a time from the meta device."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only, nothing downloads

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from autopipe.planner import plan
from autopipe.profiler.measure import SHARED_SAMPLES_CAP, profile
from autopipe.profiler.options import MeasureOptions
from profiler_models import load_example
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from autopipe.core.profile import Profile
from autopipe.core.request import PlanRequest

FAST = MeasureOptions(microbatch_sizes=())


def encoder_stack(layers: int, d: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(
            nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
    )


class WorkClock(TorchDispatchMode):
    """A seeded fake clock: time advances with the work the ops do (FLOPs plus elements
    written), each reading's increment scaled by a seeded random factor in ``1 +- noise``.

    Deterministic for a seed, and noisy in the way a shared machine is: the same work
    measures differently from sample to sample, but more work always costs more on average.
    """

    def __init__(self, seed: int, noise: float = 0.3) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.noise = noise
        self.work = self.read_work = self.value = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func.overloadpacket)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        written = sum(
            t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
        )
        self.work += flops + written
        return out

    def __call__(self) -> float:
        step = self.work - self.read_work
        self.read_work = self.work
        self.value += step * 1e-9 * (1 + self.rng.uniform(-self.noise, self.noise))
        return self.value


def noisy_profile(model: nn.Module, x: torch.Tensor, seed: int, **kw: Any) -> Profile:
    with WorkClock(seed) as clock:
        options = dataclasses.replace(FAST, clock=clock, warmup=1, repeat=5, **kw)
        return profile(model, x, options, progress=False)


def test_identical_units_measured_once_with_more_samples() -> None:
    """Layers 1..5 are the same computation as layer 1 (layer 0 differs: its input is the
    model's, which needs no gradient), so only layers 0 and 1 are timed; layer 1 gets
    SHARED_SAMPLES_CAP samples per round, and the bytes equal measuring every layer."""
    model, x = encoder_stack(6), torch.randn(2, 8, 32)
    calls: Counter[int] = Counter()
    for i, layer in enumerate(model):
        layer.register_forward_hook(lambda *_, i=i: calls.update([i]))
    # (without the B/W split, which times a step of its own per measured unit)
    shared = profile(
        model,
        x,
        dataclasses.replace(FAST, warmup=1, repeat=2, split_backward=False),
        progress=False,
    )
    assert [u.measured_as for u in shared.units] == ["", "", "1", "1", "1", "1"]
    assert shared.shared_groups() == {"1": ["1", "2", "3", "4", "5"]}
    rep = shared.units[1]
    assert all(
        (u.forward_s, u.backward_s) == (rep.forward_s, rep.backward_s) for u in shared.units[2:5]
    )
    # the last unit also carries the loss
    assert shared.units[5].forward_s == rep.forward_s + shared.loss_forward_s
    # layers 2..5 ran once, never timed (the no-grad pass counting output bytes and the
    # weight matmuls' FLOPs); layer 1 ran there, in the capture, in the in-place check, 1
    # warm-up and 2 rounds x min(5, cap) samples
    assert [calls[i] for i in range(2, 6)] == [1, 1, 1, 1]
    assert calls[1] == 3 + 1 + 2 * min(5, SHARED_SAMPLES_CAP)
    assert (
        shared.measurement is not None
        and shared.measurement.reference is False
        and shared.total_forward_s == 0.0
    )

    alone = profile(
        model, x, dataclasses.replace(FAST, warmup=0, repeat=1, share=False), progress=False
    )
    assert (
        all(u.measured_as == "" for u in alone.units)
        and alone.measurement is not None
        and alone.measurement.reference is True
    )
    for a, b in zip(alone.units, shared.units, strict=True):
        assert (a.activation_bytes, a.output_bytes, a.peak_bytes) == (
            b.activation_bytes,
            b.output_bytes,
            b.peak_bytes,
        )
    assert alone.cut_bytes == shared.cut_bytes
    # schema v1 stays: a profile without the field loads, with "" for it
    data = shared.to_dict()
    for u in data["units"]:
        del u["measured_as"]
    assert all(u.measured_as == "" for u in Profile.from_dict(data).units)


def test_same_plan_from_profiles_with_different_clock_noise() -> None:
    """An input layer, 14 identical layers and an output layer on 4 stages: the exact
    optimum puts 3 layers beside each end layer and 4 on the middle stages. Measured one by
    one, noise makes some copies cheaper and the partitioner moves layers to them (a
    different plan per noise seed); measured once, the copies cost the same and every seed
    gives the optimum."""
    torch.manual_seed(0)
    d = 32
    model = nn.Sequential(nn.Linear(d, d), *encoder_stack(14, d), nn.Linear(d, d))
    x = torch.randn(4, 8, d)

    def balance(p: Profile) -> tuple[int, ...]:
        return tuple(plan(p, PlanRequest(gpus=4, microbatches=2, baselines=False)).balance)

    shared = [noisy_profile(model, x, seed) for seed in (1, 2, 3)]
    for p in shared:
        assert len({(u.forward_s, u.backward_s) for u in p.units[1:-1]}) == 1
    assert {balance(p) for p in shared} == {(4, 4, 4, 4)}
    alone = [noisy_profile(model, x, seed, share=False) for seed in (1, 2)]
    assert balance(alone[0]) != balance(alone[1])


def test_meta_model_measured_one_unit_at_a_time() -> None:
    """A GPT built on meta is measured unit by unit: bytes equal the materialized model's,
    the model stays on meta, and at most one unit's weights existed at a time."""
    gpt = load_example("gpt")
    cfg = gpt.GPTConfig(vocab_size=512, n_layer=4, d_model=64, seq_len=16)
    x = gpt.example_inputs(4, cfg)
    real = profile(
        gpt.build_model(**vars(cfg)),
        x,
        dataclasses.replace(FAST, warmup=0, repeat=1),
        loss_fn=gpt.loss_fn,
        progress=False,
    )
    with torch.device("meta"):
        model = gpt.build_model(**vars(cfg))
    meta = profile(
        model, x, dataclasses.replace(FAST, warmup=0, repeat=1), loss_fn=gpt.loss_fn, progress=False
    )
    assert (
        meta.measurement is not None
        and meta.measurement.meta_init is True
        and meta.mode == "measured"
        and meta.device == "cpu"
    )
    assert all(p.is_meta for p in model.parameters())
    fields = (
        "activation_bytes",
        "output_bytes",
        "peak_bytes",
        "parameter_bytes",
        "optimizer_bytes",
    )
    for a, b in zip(real.units, meta.units, strict=True):
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields], a.name
        assert b.forward_s > 0 and b.backward_s > 0
    assert real.cut_bytes == meta.cut_bytes and real.input_bytes == meta.input_bytes
    largest_unit = max(u.parameter_bytes + u.buffer_bytes for u in meta.units)
    assert 0 < meta.measurement.materialized_peak_bytes <= largest_unit
    with pytest.raises(ValueError, match="reference=True needs the whole model"):
        profile(model, x, dataclasses.replace(FAST, reference=True), progress=False)

    # A unit that writes into its input (its input arrives as a detached leaf from meta).
    def relu_chain() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 32), nn.ReLU(inplace=True), nn.Linear(32, 32))

    x = torch.randn(8, 32)
    real = profile(relu_chain(), x, dataclasses.replace(FAST, warmup=0, repeat=1), progress=False)
    with torch.device("meta"):
        model = relu_chain()
    meta = profile(model, x, dataclasses.replace(FAST, warmup=0, repeat=1), progress=False)
    assert [u.activation_bytes for u in meta.units] == [u.activation_bytes for u in real.units]


def test_progress_from_meta_counts_the_units_to_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the bar of a model timed unit by unit from meta had no total
    (``4unit [09:13, 166.92s/unit]`` while 6 of 37 units were to be timed): no ETA. Its
    total is now the units timed at every micro-batch size, known before the first."""
    import tqdm.auto

    seen: list[tuple[int, int | None]] = []

    class Recording(tqdm.auto.tqdm):  # type: ignore[misc,valid-type]
        def update(self, n: float | None = 1) -> bool | None:
            out = super().update(n)
            seen.append((self.n, self.total))
            return out

    monkeypatch.setattr(tqdm.auto, "tqdm", Recording)
    gpt = load_example("gpt")
    cfg = gpt.GPTConfig(vocab_size=512, n_layer=6, d_model=64, seq_len=16)
    with torch.device("meta"):
        model = gpt.build_model(**vars(cfg))
    options = MeasureOptions(warmup=0, repeat=1, microbatch_sizes=(4, 2))
    p = profile(model, gpt.example_inputs(4, cfg), options, loss_fn=gpt.loss_fn, progress=True)
    timed = sum(1 for u in p.units if not u.measured_as)
    assert len(p.units) == 11 and timed == 6  # tok_emb, pos_emb, drop, blocks.0, ln_f, head
    assert seen == [(k, 2 * timed) for k in range(1, 2 * timed + 1)]


def test_meta_model_traced_by_export_measured_unit_by_unit() -> None:
    """The export path (a Hugging Face Llama): tensors the tracer has seen are replaced by
    the graph's own before materializing, and devices baked in as meta are retargeted."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    ids = torch.randint(0, 128, (2, 8))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    torch.manual_seed(0)
    real = profile(
        transformers.LlamaForCausalLM(cfg),
        inputs,
        dataclasses.replace(FAST, warmup=0, repeat=1),
        progress=False,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    meta = profile(model, inputs, dataclasses.replace(FAST, warmup=0, repeat=1), progress=False)
    assert meta.tracer == "export"
    assert [u.activation_bytes for u in meta.units] == [u.activation_bytes for u in real.units]
    assert meta.cut_bytes == real.cut_bytes
    assert [u.measured_as for u in meta.units] == [u.measured_as for u in real.units]
    assert meta.units[3].measured_as == "model.layers.0"


def test_cli_lists_shared_units_and_measures_from_meta_when_too_big(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``autopipe profile -v`` names the shared measurements; a model whose parameters and
    gradients exceed the free memory is built on meta and measured unit by unit."""
    import autopipe.cli as cli
    import autopipe.profiling as profiling

    gpt = str(load_example("gpt").__file__)
    out = tmp_path / "p.json"
    monkeypatch.setattr(profiling, "available_memory_bytes", lambda device: 2**20)  # 1 MiB free
    with caplog.at_level("INFO", logger="autopipe"):
        assert cli.main(["profile", gpt, "-v", "--no-cache", "-o", str(out)]) == 0
    text = capsys.readouterr()
    assert "measured one unit at a time (--meta-init)" in caplog.text
    assert "shared         13 units share 1 measurement" in text.out
    assert "blocks.0: measured once for blocks.0, blocks.1 .. blocks.12 (13 units)" in text.out
    assert "meta-init      built on meta, measured one unit at a time" in text.out
    p = Profile.load(out)
    assert (
        p.measurement is not None
        and p.measurement.meta_init is True
        and p.units[5].measured_as == "blocks.0"
    )
