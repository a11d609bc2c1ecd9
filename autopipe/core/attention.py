"""Fused (flash) attention kernel efficiency per GPU, kernel family and direction: what fraction
of a catalog GPU's BF16 datasheet peak a causal flash-attention kernel reaches on its own FLOP
count (forward ``4 s^2 d`` per head halved by the causal mask, backward 2.5 times that).
Torch-free (the planner, the profiler and the benchmarks read it).

Attention's two matmuls (``Q K^T``, ``P V``) run inside one fused kernel with the softmax
between them, so they do not reach a plain GEMM's ceiling (``autopipe.core.gemm``); how far
below depends on the kernel, the GPU and the direction. Every figure below is a kernel
benchmark published by the kernel's authors at long sequences and head dim 128, the regime of
the LLM runs priced here; none is fitted to ``benchmarks/published_runs.py``. Shorter sequences
and smaller heads run lower (the papers' plots), which is not modelled: these are upper figures.

The papers time kernels in short benchmark runs, at the boost clock, as the MAMF of
``autopipe.core.gemm`` is; a training step runs at the power limit, where the GPU's clock
settles lower for every kernel. So each figure is applied at the clock the GPU sustains
(``gemm.sustained_fraction``, the GEMMs' measured MSMF / MAMF; H100: 0.848). That the ratio
measured on GEMMs holds for flash attention is an assumption, stated: the clock is the
device's, set by the step's power draw, not the kernel's.

Kernel families, and which trainer runs which (:data:`TRAINER_KERNEL`):

- ``fa2``: FlashAttention-2 (Dao 2023), which PyTorch's SDPA flash backend is (torchtitan).
- ``cudnn``: cuDNN's fused flash attention, which Transformer Engine selects on Hopper when
  both it and FlashAttention are available (TE's ``get_attention_backend``: "Disabling
  FlashAttention to give FusedAttention preference on Hopper+ for performance reasons"),
  i.e. Megatron-Core with TE. No separate figure of cuDNN's own is used: on H100 it is priced at
  FlashAttention-3's figures, the FA3 paper's benchmarks placing cuDNN beside FA3 at long
  sequences (an assumption, stated: not a measurement of cuDNN's own share of peak).
"""

from __future__ import annotations

from autopipe.core.catalog import DEFAULT_COMPUTE_EFFICIENCY, DeviceSpec
from autopipe.core.gemm import gemm_ceiling, sustained_fraction

__all__ = [
    "ATTENTION_EFFICIENCY",
    "DEFAULT_KERNEL",
    "KERNELS",
    "TRAINER_KERNEL",
    "attention_efficiency",
    "kernel_for_trainer",
]

_FA2 = "Dao, FlashAttention-2, arXiv 2307.08691, section 4.1 (A100 80GB SXM4, BF16)"
_FA3 = "Shah et al., FlashAttention-3, arXiv 2407.08608 (H100 SXM5, BF16)"

_A100 = {
    "fa2": {
        "forward": (0.73, f"{_FA2}: forward up to 73% of the theoretical maximum"),
        "backward": (0.63, f"{_FA2}: backward up to 63% of the theoretical maximum"),
    },
}
_H100 = {
    "fa2": {
        "forward": (0.35, f"{_FA3}, abstract: FlashAttention-2 reaches only 35% utilization"),
        # FA2 paper, section 4.1: the same FA2 code on H100 reaches up to 335 TFLOP/s (34% of
        # 989), forward and backward together; the forward's 35% is used for both
        "backward": (0.35, f"{_FA2}: up to 335 TFLOP/s on H100 (no Hopper instructions)"),
    },
    "cudnn": {
        "forward": (0.75, f"{_FA3}, abstract: FlashAttention-3 up to 740 TFLOP/s, 75%"),
        # the FA3 paper: its backward is 1.5-1.75x FlashAttention-2's; the low end, 1.5 x 0.35
        "backward": (0.525, f"{_FA3}, abstract: backward 1.5-1.75x FA2's (1.5 x 0.35)"),
    },
}
ATTENTION_EFFICIENCY: dict[str, dict[str, dict[str, tuple[float, str]]]] = {
    # per catalog GPU: kernel -> direction -> (share of the BF16 datasheet peak, source)
    "A100-40GB": _A100,
    "A100-80GB": _A100,
    "H100-SXM-80GB": _H100,
    # the same Hopper compute as the H100 SXM (gemm.MAMF_FRACTION's rows say the same)
    "H800-SXM-80GB": _H100,
    "H200-141GB": _H100,
    # torchtitan's 500 W H100: the SXM's figures (measured at 700 W) on the catalog's peak
    "H100-96GB-HBM2e-500W": _H100,
}
"""Per catalog GPU, kernel family and direction: (share of the BF16 peak, source). A GPU or
kernel without a row is priced at the GPU's GEMM ceiling, as before this table."""

KERNELS = ("fa2", "cudnn")
TRAINER_KERNEL = {"torchtitan": "fa2", "megatron": "cudnn"}
"""Which attention kernel each trainer runs (module docstring)."""
DEFAULT_KERNEL = "fa2"
"""A PyTorch trainer's ``F.scaled_dot_product_attention``: the flash backend, FlashAttention-2."""


def kernel_for_trainer(trainer: str | None) -> str:
    """The attention kernel family ``trainer`` runs (:data:`TRAINER_KERNEL`); None or another
    trainer: :data:`DEFAULT_KERNEL`."""
    return TRAINER_KERNEL.get(trainer or "", DEFAULT_KERNEL)


def attention_efficiency(
    spec: DeviceSpec, kernel: str = DEFAULT_KERNEL, direction: str = "forward"
) -> float:
    """Share of ``spec``'s BF16 peak a causal flash-attention ``kernel`` reaches in
    ``direction`` (``forward`` / ``backward``) in a training run: the table's figure at the
    clock the GPU sustains (``sustained_fraction``), never above the GPU's GEMM ceiling
    (``gemm_ceiling``); the GEMM ceiling itself where the table has no figure (or the spec's
    efficiency was calibrated: the calibration stands for every kernel)."""
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel {kernel!r}; use one of {', '.join(KERNELS)}")
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction {direction!r}; use forward or backward")
    ceiling = gemm_ceiling(spec)
    row = ATTENTION_EFFICIENCY.get(spec.name, {}).get(kernel)
    if row is None or spec.compute_efficiency != DEFAULT_COMPUTE_EFFICIENCY:
        return ceiling
    return min(row[direction][0] * sustained_fraction(spec), ceiling)
