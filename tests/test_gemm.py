"""autopipe.core.gemm: matmul efficiency per catalog GPU and GEMM shape, from the published
maximum achievable matmul FLOP/s (the ceiling), the SMs a GEMM's output tiles fill and its
memory bound."""

from __future__ import annotations

import pytest

from autopipe.core.catalog import get_device
from autopipe.core.gemm import (
    MAMF_FRACTION,
    SM_COUNT,
    TILE,
    gemm_ceiling,
    gemm_compute_s,
    gemm_efficiency,
    gemm_s,
)

GPUS = ["A100-80GB", "H100-SXM-80GB", "H200-141GB", "MI300X-192GB", "H100-96GB-HBM2e-500W"]


def test_large_square_gemm_reaches_the_published_ceiling_per_gpu() -> None:
    """A big GEMM (8192^3) is compute-bound and fills every SM: its efficiency is the table's
    MAMF fraction, different per GPU (A100 271.2 / 312, H100 794.5 / 989, MI300X 668.4 / 1300)."""
    assert gemm_efficiency(get_device("A100-80GB"), 8192, 8192, 8192) == pytest.approx(271.2 / 312)
    assert gemm_efficiency(get_device("H100-SXM-80GB"), 8192, 8192, 8192) == pytest.approx(
        794.5 / 989
    )
    assert gemm_efficiency(get_device("MI300X-192GB"), 8192, 8192, 8192) == pytest.approx(
        668.4 / 1300
    )
    assert gemm_ceiling(get_device("H100-SXM-80GB"), "float8") == pytest.approx(1402.6 / 1979)
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
    gemv_s = gemm_s(spec, 8192, 1, 8192)
    moved = 2 * (8192 * 8192 + 8192 + 8192)
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
