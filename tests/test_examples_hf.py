"""The Hugging Face examples: tiny by default, the published shapes as named factories.

The named factories are checked on the meta device (nothing allocated) against the published
parameter counts of the checkpoints they stand for, so a mistyped shape cannot pass for a
Llama-2 or a T5; the tiny defaults take a training step with the model's own loss.
"""

from __future__ import annotations

import math

import pytest
import torch

from autopipe.modelfile import load_model_file

pytest.importorskip("transformers")

PUBLISHED_PARAMETERS = {
    # Hugging Face's meta-llama/Llama-2-*-hf and google-t5/t5-* checkpoints.
    "examples/hf_llama.py:llama2_7b": 6_738_415_616,
    "examples/hf_llama.py:llama2_13b": 13_015_864_320,
    "examples/hf_llama.py:llama2_70b": 68_976_648_192,
    "examples/hf_t5.py:t5_small": 60_506_624,
    "examples/hf_t5.py:t5_base": 222_903_552,
    "examples/hf_t5.py:t5_large": 737_668_096,
}


@pytest.mark.parametrize("spec", sorted(PUBLISHED_PARAMETERS))
def test_named_factories_have_the_published_shapes(spec: str) -> None:
    model_file = load_model_file(spec)
    model = model_file.build(device="meta")
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[spec]
    assert model.config.use_cache is False  # built for training
    inputs = model_file.inputs(2)
    assert set(inputs) == {"input_ids", "labels"}
    assert all(t.dtype == torch.int64 and t.shape[0] == 2 for t in inputs.values())
    assert int(inputs["input_ids"].max()) < model.config.vocab_size


@pytest.mark.parametrize("spec", ["examples/hf_llama.py", "examples/hf_t5.py"])
def test_tiny_defaults_train_with_their_own_loss(spec: str) -> None:
    model_file = load_model_file(spec)
    model = model_file.build()
    assert sum(p.numel() for p in model.parameters()) < 1_000_000  # plans in seconds on a CPU
    inputs = model_file.inputs(model_file.default_batch_size())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    # A random model's cross entropy starts near log(vocabulary) and goes down.
    assert losses[0] == pytest.approx(math.log(model.config.vocab_size), rel=0.1)
    assert losses[-1] < losses[0], losses
    # Every rank of `autopipe run` builds the same weights.
    again = model_file.build()
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            load_model_file(spec).build().state_dict().values(),
            again.state_dict().values(),
            strict=True,
        )
    )


def test_the_tiny_t5_profiles_without_a_linearity_warning() -> None:
    """T5's first block computes the relative position bias, (1, heads, q, k) with no batch
    dimension, and hands it to every later block: the output bytes of encoder.block.0 and
    decoder.block.0 are affine in the batch, not proportional (at b = 2 twice the linear
    extrapolation from b = 8). The profiler warned "bytes do not scale linearly" on it.
    The error is 86 KB against 1.6 MB of parameters: not material to any stage's memory,
    and the warning now judges it against that memory."""
    import warnings

    from autopipe.profiler.measure import profile
    from autopipe.profiler.options import MeasureOptions

    model_file = load_model_file("examples/hf_t5.py")
    model, inputs = model_file.build(), model_file.inputs(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        measured = profile(model, inputs, MeasureOptions(warmup=0, repeat=1), progress=False)
    assert measured.measurement is not None
    assert measured.measurement.microbatch_sizes == [8, 2]  # two sizes: the check ran
