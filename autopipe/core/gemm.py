"""Matmul efficiency per GPU and GEMM shape: what fraction of a catalog GPU's datasheet peak a
``(m x k) @ (k x n)`` matmul reaches. Torch-free (the planner and the profiler both read it).

One flat ``compute_efficiency`` for every GPU and every shape misprices both ends: an A100
sustains a larger share of its peak than an H100, an MI300X a much smaller one, and a thin GEMM
(a TP-split projection, a small micro-batch) neither fills the GPU nor stays compute-bound.
The model here has four parts, each a published figure or a datasheet figure, none fitted to
the runs of ``benchmarks/published_runs.py``:

1. **Ceiling** (:data:`MAMF_FRACTION`): the Maximum Achievable Matmul FLOP/s over the
   datasheet peak, per GPU and dtype, as measured by brute-force shape search (Stas Bekman,
   "Machine Learning Engineering", compute/accelerator/README.md, table "Maximum Achievable
   Matmul FLOPS comparison table", BF16 and FP8 rows; H100 PCIe: the same benchmark run by
   github.com/mag-/gpu_benchmark, README table). The best shape reaches it, no shape exceeds it.
2. **Filling the GPU**: cuBLAS computes one output tile per thread block and runs one block per
   SM at a time, so a GEMM with fewer output tiles than SMs leaves SMs idle (NVIDIA, "Matrix
   Multiplication Background User's Guide", sections "Typical Tile Dimensions in cuBLAS" and
   "Wave Quantization"): the compute rate is scaled by ``min(1, m n / (T^2 SMs))`` with the
   guide's 128 x 128 tile and the GPU's SM count (its datasheet / whitepaper). Continuous
   (tile and wave quantization's steps are averaged out) and without split-K, which cuBLAS
   uses for a thin output with a long ``k``: a lower bound there.
3. **Memory bound** (the same guide, "Math And Memory Bounds"): a GEMM moves at least
   ``(m k + k n + m n)`` elements; when that takes longer at the GPU's bandwidth times its
   memory efficiency than the math, the GEMM is memory-bound.

4. **Sustained clock** (:data:`SUSTAINED_FRACTION`): a training step is one long run at the
   board's power limit, and there the SM clock settles below the boost clock a short MAMF
   burst runs at. Bekman's benchmark measures both on the same GPU: the Maximum *Sustainable*
   Matmul FLOP/s (MSMF, after a thermal soak, the clock at the power-saturated floor) beside
   the MAMF (a burst at boost). Their ratio scales the ceiling where it was measured
   (H200 bf16, every GPU of the node computing: MSMF 698.6 of MAMF 823.9 TFLOP/s, 0.848;
   the H100 SXM, H800 and torchtitan's 500 W H100 are the same Hopper compute). Where no
   MSMF was published (A100) the MAMF stands, and the MI300X's MAMF is already at its cap
   (it "hits its 750 W cap within one BF16 kernel": no boost burst to correct).

``efficiency = 2 m n k / (peak x max(compute_s, memory_s))``: at most the ceiling (MAMF x
the sustained fraction), rising (never falling) with each of ``m``, ``n``, ``k``. A GPU
without a published measurement has its ``compute_efficiency`` (0.7, an assumption) as its ceiling; a spec whose
``compute_efficiency`` was set (``--efficiency``, a calibration) has that as its ceiling, the
shape effects kept; a GPU without a recorded SM count (a spec file's, a calibrated copy) is
priced flat at its ceiling for every shape, as before this model.
"""

from __future__ import annotations

from autopipe.core.catalog import DEFAULT_COMPUTE_EFFICIENCY, DeviceSpec, normalize_dtype

__all__ = [
    "MAMF_FRACTION",
    "SM_COUNT",
    "SUSTAINED_FRACTION",
    "TILE",
    "gemm_ceiling",
    "gemm_compute_s",
    "gemm_efficiency",
    "gemm_s",
    "mamf_ceiling",
    "sustained_fraction",
]

_BEKMAN = (
    "https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/README.md"
    "#maximum-achievable-matmul-flops-comparison-table"
)
_MAG = "https://github.com/mag-/gpu_benchmark (README, table Stats)"

MAMF_FRACTION: dict[str, dict[str, tuple[float, str]]] = {
    # BF16 MAMF / datasheet TFLOP/s, and the source of each row.
    "A100-40GB": {"bfloat16": (271.2 / 312, f"{_BEKMAN}: A100 SXM 271.2 of 312")},
    "A100-80GB": {"bfloat16": (271.2 / 312, f"{_BEKMAN}: A100 SXM 271.2 of 312")},
    "H100-SXM-80GB": {
        "bfloat16": (794.5 / 989, f"{_BEKMAN}: H100 SXM 794.5 of 989"),
        "float8": (1402.6 / 1979, f"{_BEKMAN}: H100 SXM FP8 1402.6 of 1979"),
    },
    # the H800 is the H100 SXM's die and clocks with export-limited NVLink and FP64
    "H800-SXM-80GB": {
        "bfloat16": (794.5 / 989, f"{_BEKMAN}: H100 SXM 794.5 of 989 (same compute)"),
        "float8": (1402.6 / 1979, f"{_BEKMAN}: H100 SXM FP8 1402.6 of 1979 (same compute)"),
    },
    "H200-141GB": {
        "bfloat16": (794.5 / 989, f"{_BEKMAN}: H100 SXM 794.5 of 989, 'H200 is the same'"),
        "float8": (1453.4 / 1979, f"{_BEKMAN}: H200 SXM FP8 1453.4 of 1979"),
    },
    "H100-PCIe-80GB": {"bfloat16": (499.5 / 756, f"{_MAG}: H100 PCIe 499.5 of 756")},
    "MI300X-192GB": {"bfloat16": (668.4 / 1300, f"{_BEKMAN}: MI300X 668.4 of 1300")},
    # torchtitan's 500 W H100 (96 GB HBM2e): no published MAMF; the H100 SXM's fraction is
    # applied to the catalog's (already uncertain, midpoint) peak: the same silicon, but its
    # power limit is lower than the 700 W the SXM figure was measured at (not measured here).
    "H100-96GB-HBM2e-500W": {
        "bfloat16": (794.5 / 989, f"{_BEKMAN}: H100 SXM 794.5 of 989 (same die, 700 W)"),
        "float8": (1402.6 / 1979, f"{_BEKMAN}: H100 SXM FP8 1402.6 of 1979 (same die, 700 W)"),
    },
}
"""Per catalog GPU and dtype: (MAMF / datasheet peak, source). float16 reads bfloat16's row."""

_MSMF = (
    "https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/benchmarks/"
    "README.md (section 'What we measured: alone vs all-8 concurrent', H200 bf16, all 8 GPUs"
    " x 5 rounds: MSMF 698.6, MAMF 823.9 TFLOP/s)"
)
_HOPPER_SUSTAINED = (698.6 / 823.9, _MSMF)
SUSTAINED_FRACTION: dict[str, tuple[float, str]] = {
    # MSMF / MAMF measured together on one H200 node under full load; the H100 SXM, H800 and
    # the 500 W H100 are the same Hopper die and clocks (MAMF_FRACTION's rows say the same).
    # The 500 W part's lower power limit would settle its clock lower still: not measured,
    # not applied.
    "H200-141GB": _HOPPER_SUSTAINED,
    "H100-SXM-80GB": _HOPPER_SUSTAINED,
    "H800-SXM-80GB": _HOPPER_SUSTAINED,
    "H100-96GB-HBM2e-500W": _HOPPER_SUSTAINED,
}
"""Per catalog GPU: (sustained over burst matmul FLOP/s, MSMF / MAMF, source). The share of its
burst ceiling a GEMM keeps once the GPU runs at its power limit, as a training run does. A GPU
without a row keeps its MAMF (no measurement: A100, H100 PCIe; or no burst above the power cap:
MI300X, whose MAMF the same benchmark notes is taken at its 750 W cap)."""

SM_COUNT: dict[str, int] = {
    # NVIDIA's architecture whitepapers (A100: 108 SMs; H100 SXM5: 132, PCIe: 114; H800 and
    # H200 as H100 SXM5) and AMD's MI300X data sheet (304 compute units).
    "A100-40GB": 108,
    "A100-80GB": 108,
    "H100-SXM-80GB": 132,
    "H800-SXM-80GB": 132,
    "H200-141GB": 132,
    "H100-PCIe-80GB": 114,
    "H100-96GB-HBM2e-500W": 132,
    "MI300X-192GB": 304,
}
"""Streaming multiprocessors (compute units) per GPU: how many output tiles run at once."""

TILE = 128
"""Output tile edge (elements) of a cuBLAS GEMM kernel: the Matrix Multiplication Background
guide's typical 128 x 128 tile (its range is 64 x 64 to 256 x 128)."""


def _dtype_key(dtype: str) -> str:
    key = normalize_dtype(dtype)
    return "bfloat16" if key == "float16" else key


def mamf_ceiling(spec: DeviceSpec, dtype: str = "bfloat16") -> float:
    """The most of ``spec``'s ``dtype`` peak any GEMM reaches in a short burst at the boost
    clock: its published MAMF fraction, or its flat ``compute_efficiency`` where none is
    published (or the spec's efficiency was set)."""
    if spec.compute_efficiency != DEFAULT_COMPUTE_EFFICIENCY:
        return spec.compute_efficiency
    row = MAMF_FRACTION.get(spec.name, {})
    return row[_dtype_key(dtype)][0] if _dtype_key(dtype) in row else spec.compute_efficiency


def sustained_fraction(spec: DeviceSpec) -> float:
    """The share of its boost-clock throughput ``spec`` keeps at its power limit
    (:data:`SUSTAINED_FRACTION`; 1 where none is published)."""
    return SUSTAINED_FRACTION.get(spec.name, (1.0, ""))[0]


def gemm_ceiling(spec: DeviceSpec, dtype: str = "bfloat16") -> float:
    """The most of ``spec``'s ``dtype`` peak any GEMM of a training run reaches: the burst
    ceiling (:func:`mamf_ceiling`) at the clock the GPU sustains at its power limit
    (:data:`SUSTAINED_FRACTION`; every dtype, the clock being the die's). A spec whose
    efficiency was set (calibration) and a GPU without a published MAMF keep their
    ``compute_efficiency`` as is."""
    ceiling = mamf_ceiling(spec, dtype)
    if spec.compute_efficiency != DEFAULT_COMPUTE_EFFICIENCY:
        return ceiling
    if _dtype_key(dtype) not in MAMF_FRACTION.get(spec.name, {}):
        return ceiling
    return ceiling * sustained_fraction(spec)


def gemm_compute_s(
    spec: DeviceSpec, m: float, n: float, k: float, dtype: str = "bfloat16", batch: float = 1
) -> float:
    """Seconds of the math of ``batch`` ``(m x k) @ (k x n)`` matmuls: at the ceiling
    (:func:`gemm_ceiling`) times the share of SMs the output tiles fill (a GPU without a
    recorded SM count: at the ceiling, any shape)."""
    flops = 2.0 * m * n * k * batch
    if flops <= 0:
        return 0.0
    rate = spec.peak_for(dtype) * gemm_ceiling(spec, dtype)
    if spec.name in SM_COUNT:
        rate *= min(1.0, m * n * batch / (TILE * TILE * SM_COUNT[spec.name]))
    return flops / rate


def gemm_s(
    spec: DeviceSpec, m: float, n: float, k: float, dtype: str = "bfloat16", batch: float = 1
) -> float:
    """Seconds of ``batch`` independent ``(m x k) @ (k x n)`` matmuls in ``dtype`` on ``spec``
    (module docstring): the math (:func:`gemm_compute_s`), or moving the operands and the
    result at the sustained bandwidth, whichever is longer (a GPU without a recorded SM count:
    the math alone, flat as before)."""
    if min(m, n, k, batch) <= 0:
        return 0.0
    compute_s = gemm_compute_s(spec, m, n, k, dtype, batch)
    if spec.name not in SM_COUNT:
        return compute_s
    key = _dtype_key(dtype)
    size = 1 if key == "float8" else 4 if key in ("float32", "tfloat32") else 2
    moved = size * (m * k + k * n + m * n) * batch
    memory_s = moved / (spec.memory_bandwidth_bytes_per_s * spec.memory_efficiency)
    return max(compute_s, memory_s)


def gemm_efficiency(
    spec: DeviceSpec, m: float, n: float, k: float, dtype: str = "bfloat16", batch: float = 1
) -> float:
    """Achieved FLOP/s over ``spec``'s ``dtype`` peak for a ``(m x k) @ (k x n)`` matmul (``batch``
    of them): in (0, :func:`gemm_ceiling`], non-decreasing in each of ``m``, ``n``, ``k``."""
    seconds = gemm_s(spec, m, n, k, dtype, batch)
    if seconds <= 0:
        return gemm_ceiling(spec, dtype)
    return 2.0 * m * n * k * batch / (seconds * spec.peak_for(dtype))
