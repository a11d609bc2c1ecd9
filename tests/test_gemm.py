"""autopipe.core.gemm: matmul efficiency per catalog GPU and GEMM shape, from the published
maximum achievable matmul FLOP/s (the ceiling), the SMs a GEMM's output tiles fill and its
memory bound."""

from __future__ import annotations

import pytest

from autopipe.core.catalog import get_device
from autopipe.core.gemm import (
    MAMF_FRACTION,
    SM_COUNT,
    SUSTAINED_FRACTION,
    TILE,
    gemm_ceiling,
    gemm_compute_s,
    gemm_efficiency,
    gemm_s,
    mamf_ceiling,
    sustained_fraction,
)

GPUS = ["A100-80GB", "H100-SXM-80GB", "H200-141GB", "MI300X-192GB", "H100-96GB-HBM2e-500W"]


def test_large_square_gemm_reaches_the_published_ceiling_per_gpu() -> None:
    """A big GEMM (8192^3) is compute-bound and fills every SM: its efficiency is the table's
    MAMF fraction at the clock the GPU sustains at its power limit, different per GPU (A100
    271.2 / 312, no MSMF published; H100 794.5 / 989 x 698.6 / 823.9, Hopper's MSMF over its
    MAMF; MI300X 668.4 / 1300, measured at its power cap already)."""
    assert gemm_efficiency(get_device("A100-80GB"), 8192, 8192, 8192) == pytest.approx(271.2 / 312)
    assert gemm_efficiency(get_device("H100-SXM-80GB"), 8192, 8192, 8192) == pytest.approx(
        794.5 / 989 * 698.6 / 823.9
    )
    assert gemm_efficiency(get_device("MI300X-192GB"), 8192, 8192, 8192) == pytest.approx(
        668.4 / 1300
    )
    assert gemm_ceiling(get_device("H100-SXM-80GB"), "float8") == pytest.approx(
        1402.6 / 1979 * 698.6 / 823.9
    )
    assert gemm_ceiling(get_device("H100-SXM-80GB"), "fp16") == gemm_ceiling(
        get_device("H100-SXM-80GB"), "bf16"
    )
    for name, row in MAMF_FRACTION.items():
        for dtype, (fraction, source) in row.items():
            assert 0 < fraction <= 1 and source, (name, dtype)


@pytest.mark.parametrize("name", GPUS)
def test_efficiency_is_bounded_by_the_ceiling_and_monotone_in_each_dimension(name: str) -> None:
    spec = get_device(name)
    ceiling = gemm_ceiling(spec)
    sizes = [16, 64, 128, 512, 1024, 4096, 16384, 65536]
    for fixed in (128, 4096):
        for axis in range(3):
            effs = []
            for s in sizes:
                shape = [fixed, fixed, fixed]
                shape[axis] = s
                effs.append(gemm_efficiency(spec, *shape))
            assert all(0 < e <= ceiling + 1e-12 for e in effs), (name, axis, effs)
            assert all(b >= a - 1e-12 for a, b in zip(effs, effs[1:], strict=False)), (
                name,
                axis,
                effs,
            )


def test_thin_gemms_lose_to_idle_sms_and_to_memory() -> None:
    """A 4096 x 128 output has 32 tiles of 128 x 128 for an H100's 132 SMs: a quarter of the
    ceiling when compute-bound; a matrix-vector product (n = 1) is memory-bound."""
    spec = get_device("H100-SXM-80GB")
    tiles = 4096 * 128 / (TILE * TILE)
    eff = gemm_efficiency(spec, 4096, 128, 65536)
    assert eff == pytest.approx(gemm_ceiling(spec) * tiles / SM_COUNT[spec.name])
    gemv_s = gemm_s(spec, 65536, 1, 8192)
    moved = 2 * (65536 * 8192 + 8192 + 65536)
    assert gemv_s == pytest.approx(moved / (spec.memory_bandwidth_bytes_per_s * 0.8))


def test_unmeasured_or_recalibrated_gpus_keep_their_efficiency_as_the_ceiling() -> None:
    """No published measurement nor SM count (V100): the flat ``compute_efficiency`` for every
    shape, as before the table; a spec whose efficiency was set (``--efficiency``): that is
    its ceiling, the shape effects stay."""
    v100 = get_device("V100-32GB")
    assert gemm_efficiency(v100, 8192, 8192, 8192, "float16") == pytest.approx(0.7)
    assert gemm_efficiency(v100, 64, 64, 64, "float16") == pytest.approx(0.7)
    h100 = get_device("H100-SXM-80GB")
    tuned = h100.with_efficiency(compute=0.55)
    assert gemm_ceiling(tuned) == 0.55
    assert gemm_efficiency(tuned, 8192, 8192, 8192) == pytest.approx(0.55)
    assert gemm_compute_s(tuned, 4096, 128, 4096) == pytest.approx(
        gemm_compute_s(h100, 4096, 128, 4096) * gemm_ceiling(h100) / 0.55
    )


def test_a_training_run_prices_gemms_at_the_sustained_clock_not_the_burst() -> None:
    """The burst MAMF is what a short benchmark reaches at the boost clock; a training step runs
    at the power limit, where Bekman's benchmark measured the H200 (all 8 GPUs of a node busy)
    at 698.6 of its 823.9 burst TFLOP/s. The Hopper GPUs share that ratio, every dtype alike;
    a GPU without a measured MSMF keeps its MAMF, and a calibrated spec its calibration."""
    hopper = 698.6 / 823.9
    for name in ("H100-SXM-80GB", "H200-141GB", "H800-SXM-80GB", "H100-96GB-HBM2e-500W"):
        spec = get_device(name)
        assert sustained_fraction(spec) == pytest.approx(hopper)
        for dtype in ("bfloat16", "float8"):
            assert gemm_ceiling(spec, dtype) == pytest.approx(mamf_ceiling(spec, dtype) * hopper)
    # an 8192^3 bf16 GEMM on an H100 SXM: 989.4 x 0.803 x 0.848 = 674 TFLOP/s, so 1.18x slower
    # than at the burst ceiling
    h100 = get_device("H100-SXM-80GB")
    assert 2 * 8192**3 / gemm_s(h100, 8192, 8192, 8192) == pytest.approx(
        989.4e12 * 794.5 / 989 * hopper
    )
    for name in ("A100-80GB", "MI300X-192GB", "H100-PCIe-80GB"):
        assert sustained_fraction(get_device(name)) == 1.0
        assert gemm_ceiling(get_device(name)) == mamf_ceiling(get_device(name))
    assert gemm_ceiling(h100.with_efficiency(compute=0.55)) == 0.55
    assert gemm_ceiling(get_device("V100-32GB"), "float16") == pytest.approx(0.7)
    for fraction, source in SUSTAINED_FRACTION.values():
        assert 0 < fraction <= 1 and "MSMF" in source
