"""autopipe.core.attention: flash-attention kernel efficiency per GPU, kernel family and
direction (published kernel benchmarks), bounded by the GPU's GEMM ceiling, chosen per trainer."""

from __future__ import annotations

import dataclasses

import pytest

from autopipe.core.attention import (
    ATTENTION_EFFICIENCY,
    DEFAULT_KERNEL,
    KERNELS,
    attention_efficiency,
    kernel_for_trainer,
)
from autopipe.core.catalog import get_device
from autopipe.core.gemm import gemm_ceiling, mamf_ceiling, sustained_fraction


def test_every_figure_is_sourced_and_below_the_gemm_ceiling() -> None:
    """A fused attention kernel never beats the GPU's best plain GEMM at the same clock (burst:
    A100 0.869, H100 0.803): each tabled figure has a source and lies in (0, ceiling]; a run
    gets it at the clock the GPU sustains (H100: x 698.6 / 823.9), like the GEMMs."""
    for gpu, kernels in ATTENTION_EFFICIENCY.items():
        spec = get_device(gpu)
        for kernel, row in kernels.items():
            assert kernel in KERNELS
            for direction in ("forward", "backward"):
                value, source = row[direction]
                assert source.strip(), (gpu, kernel, direction)
                assert 0 < value <= mamf_ceiling(spec), (gpu, kernel, direction)
                assert attention_efficiency(spec, kernel, direction) == pytest.approx(
                    value * sustained_fraction(spec)
                )
                assert attention_efficiency(spec, kernel, direction) <= gemm_ceiling(spec)


def test_published_figures_per_gpu_and_kernel() -> None:
    """FlashAttention-2 on A100: 73% forward, 63% backward (FA2 paper); on H100 35% (FA3
    paper); cuDNN on H100 at FlashAttention-3's 75% forward, 1.5 x 0.35 backward; the H100's
    at its sustained clock (MSMF / MAMF 698.6 / 823.9), the A100's as published (no MSMF)."""
    a100, h100 = get_device("A100-80GB"), get_device("H100-SXM-80GB")
    hopper = 698.6 / 823.9
    assert attention_efficiency(a100, "fa2", "forward") == pytest.approx(0.73)
    assert attention_efficiency(a100, "fa2", "backward") == pytest.approx(0.63)
    assert attention_efficiency(h100, "fa2", "forward") == pytest.approx(0.35 * hopper)
    assert attention_efficiency(h100, "cudnn", "forward") == pytest.approx(0.75 * hopper)
    assert attention_efficiency(h100, "cudnn", "backward") == pytest.approx(0.525 * hopper)


def test_untabled_gpu_kernel_or_calibrated_spec_falls_back_to_the_gemm_ceiling() -> None:
    """No figure (cuDNN on A100, any kernel on MI300X) or a calibrated efficiency: the GEMM
    ceiling, as attention was priced before the table."""
    a100, mi300 = get_device("A100-80GB"), get_device("MI300X-192GB")
    assert attention_efficiency(a100, "cudnn") == pytest.approx(gemm_ceiling(a100))
    assert attention_efficiency(mi300, "fa2", "backward") == pytest.approx(gemm_ceiling(mi300))
    calibrated = dataclasses.replace(get_device("H100-SXM-80GB"), compute_efficiency=0.5)
    assert attention_efficiency(calibrated, "fa2") == 0.5


def test_kernel_is_selected_per_trainer() -> None:
    """torchtitan runs SDPA's flash backend (FlashAttention-2), Megatron with Transformer
    Engine cuDNN's fused attention; anything else the default (SDPA: FlashAttention-2)."""
    assert kernel_for_trainer("torchtitan") == "fa2"
    assert kernel_for_trainer("megatron") == "cudnn"
    assert kernel_for_trainer(None) == DEFAULT_KERNEL == "fa2"
    h100 = get_device("H100-SXM-80GB")
    tt = attention_efficiency(h100, kernel_for_trainer("torchtitan"))
    mg = attention_efficiency(h100, kernel_for_trainer("megatron"))
    assert tt < mg


def test_bad_kernel_or_direction_is_refused() -> None:
    spec = get_device("H100-SXM-80GB")
    with pytest.raises(ValueError, match="attention kernel"):
        attention_efficiency(spec, "fa9")
    with pytest.raises(ValueError, match="direction"):
        attention_efficiency(spec, "fa2", "sideways")
