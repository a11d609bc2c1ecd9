"""Accelerator specs for analytic profiling: plan for GPUs you do not have.

A :class:`DeviceSpec` holds the datasheet figures the analytic cost model needs
(peak dense FLOP/s per dtype, memory bandwidth and capacity, device-to-device link
bandwidth) plus the efficiency factors that turn peaks into realistic rates.
This module is torch-free and holds device specs only: the CLI lists and loads devices
without importing torch, and the planner reads these specs (``Cluster.from_catalog``) without
this module knowing about plans.

Conventions (all entries follow them):

* FLOP/s are *dense* peaks (no 2:4 structured sparsity). ``"float32"`` is plain
  (non-tensor-core) FP32; ``"tfloat32"`` is the TF32 tensor-core rate, used only when
  the caller allows TF32. ``"bfloat16"``/``"float16"`` are tensor-core rates with FP32
  accumulation (what mixed-precision training uses).
* ``memory_bytes`` is the total the driver reports (``nvidia-smi``'s total, which is
  ``torch.cuda.get_device_properties(i).total_memory``), so that a catalog device and the
  same device measured agree: an "80GB" H100 reports 81559 MiB = 85.5e9 bytes, 7% more than
  80e9. Where no reported total is recorded (``REPORTED_MIB``) the marketed capacity is read
  as decimal bytes (80 GB -> 80e9), which errs small. Plans keep headroom for the CUDA
  context and the allocator on top.
* ``link_bandwidth_bytes_per_s`` is *per direction* between two adjacent pipeline
  devices in the usual 8-GPU platform (datasheets quote NVLink bidirectional totals,
  which are halved here).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopipe.core.datafile import is_named_pipe
from autopipe.core.errors import UsageError
from autopipe.core.humanize import parse_bandwidth, parse_bytes

TERA = 1e12
GB = 1e9

DEFAULT_COMPUTE_EFFICIENCY = 0.7
"""Fraction of peak FLOP/s that large matmuls/convolutions reach (cuBLAS bf16 GEMMs on
A100/H100 typically reach 60-80 % of the dense datasheet peak)."""
DEFAULT_MEMORY_EFFICIENCY = 0.8
"""Fraction of peak memory bandwidth that memory-bound kernels (elementwise, norms,
softmax) reach; streaming kernels on HBM reach roughly 80-90 %."""
DEFAULT_KERNEL_LAUNCH_OVERHEAD_S = 8e-6
"""Fixed cost per kernel in PyTorch eager mode (CUDA launch plus dispatcher/Python),
a few microseconds each; this is the part of a micro-batch that does not shrink with b."""

DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
    "tf32": "tfloat32",
    "tfloat32": "tfloat32",
    "fp8": "float8",
    "float8": "float8",
}


class DeviceSpecError(UsageError, ValueError):
    """A device name or spec file is unknown or invalid."""


class DeviceListError(DeviceSpecError):
    """A ``NAME[:COUNT],...`` device list is malformed (the message starts with the list, so a
    caller can put the flag that gave it in front)."""


@dataclass(frozen=True)
class DeviceSpec:
    """Datasheet figures of one accelerator plus cost-model efficiency factors.

    Units are in the field names: FLOP/s, bytes/s, bytes, seconds.
    """

    name: str
    peak_flops_per_s: dict[str, float]
    """Dense peak FLOP/s by dtype name: ``bfloat16``, ``float16``, ``float32``, ``tfloat32``,
    and ``float8`` (FP8 tensor cores, where the GPU has them)."""
    memory_bandwidth_bytes_per_s: float
    memory_bytes: int
    link_bandwidth_bytes_per_s: float
    """Per direction, device to the next device in pipeline order."""
    link_name: str = ""
    link_latency_s: float = 0.0
    kernel_launch_overhead_s: float = DEFAULT_KERNEL_LAUNCH_OVERHEAD_S
    compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY
    memory_efficiency: float = DEFAULT_MEMORY_EFFICIENCY
    aliases: tuple[str, ...] = ()
    vendor: str = ""
    source: str = ""
    """Where the figures come from (datasheet URL)."""
    extra: dict[str, Any] = field(default_factory=dict)
    gpus_per_node: int = 8
    """Devices in one node of the usual platform (the 8-GPU baseboard)."""
    inter_node_bandwidth_bytes_per_s: float = 0.0
    """Per device, per direction, between nodes: the platform's network adapter for each GPU;
    0: not known (give ``--inter-node-bandwidth`` for a mesh that spans nodes)."""
    inter_node_link_name: str = ""
    inter_node_source: str = ""
    """Where the inter-node figure comes from."""
    collective_latency_s: float = 0.0
    """Latency of one step of a ring collective between two GPUs of a node (one NVLink hop; a
    ring of G ranks over N nodes takes G - N such steps): the mesh planner's TP and DP
    collectives pay it per step."""
    inter_node_collective_latency_s: float = 0.0
    """The same per step across nodes (one network hop; N - 1 of them)."""
    collective_base_latency_s: float = 0.0
    """Latency every collective pays once, beside its steps."""
    overlap_compute_loss: float = 0.0
    """Share of a collective's seconds that overlapped compute loses (NCCL's kernels take SMs
    and memory bandwidth from the GEMMs they overlap); 0: overlap is free."""

    def peak_for(self, dtype: str, *, allow_tf32: bool = False) -> float:
        """Dense peak FLOP/s for matmuls in ``dtype`` (``"bfloat16"``, ``"fp16"``, ...)."""
        key = normalize_dtype(dtype)
        if key == "float32" and allow_tf32 and "tfloat32" in self.peak_flops_per_s:
            key = "tfloat32"
        if key not in self.peak_flops_per_s:
            have = ", ".join(sorted(self.peak_flops_per_s))
            raise DeviceSpecError(
                f"{self.name} has no {key} peak (it lists {have}); pick one of those dtypes"
            )
        return self.peak_flops_per_s[key]

    def with_efficiency(
        self,
        compute: float | None = None,
        memory: float | None = None,
        kernel_launch_overhead_s: float | None = None,
    ) -> DeviceSpec:
        """A copy with some efficiency factors replaced (``None`` keeps the current one)."""
        changes: dict[str, Any] = {}
        if compute is not None:
            changes["compute_efficiency"] = compute
        if memory is not None:
            changes["memory_efficiency"] = memory
        if kernel_launch_overhead_s is not None:
            changes["kernel_launch_overhead_s"] = kernel_launch_overhead_s
        spec = dataclasses.replace(self, **changes)
        _validate(spec, origin=self.name)
        return spec

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["aliases"] = list(self.aliases)
        return data


def normalize_dtype(dtype: Any) -> str:
    """``torch.bfloat16``, ``"bf16"``, ``"bfloat16"`` -> ``"bfloat16"`` (no torch import)."""
    text = str(dtype).removeprefix("torch.").lower()
    try:
        return DTYPE_ALIASES[text]
    except KeyError:
        raise DeviceSpecError(
            f"unknown dtype {dtype!r}; use one of bfloat16, float16, float32 (or bf16/fp16/fp32)"
        ) from None


def _gpu(
    name: str,
    *,
    bf16_tflops: float | None,
    fp16_tflops: float,
    fp32_tflops: float,
    tf32_tflops: float | None,
    bandwidth_gb_s: float,
    memory_gb: float,
    link_gb_s_per_direction: float,
    link_name: str,
    vendor: str,
    source: str,
    aliases: tuple[str, ...],
) -> DeviceSpec:
    peaks = {"float16": fp16_tflops * TERA, "float32": fp32_tflops * TERA}
    if bf16_tflops is not None:
        peaks["bfloat16"] = bf16_tflops * TERA
    if tf32_tflops is not None:
        peaks["tfloat32"] = tf32_tflops * TERA
    return DeviceSpec(
        name=name,
        peak_flops_per_s=peaks,
        memory_bandwidth_bytes_per_s=bandwidth_gb_s * GB,
        memory_bytes=int(memory_gb * GB),
        link_bandwidth_bytes_per_s=link_gb_s_per_direction * GB,
        link_name=link_name,
        vendor=vendor,
        source=source,
        aliases=aliases,
    )


REPORTED_MIB = {
    "A100-40GB": 40960,
    "A100-80GB": 81920,
    "H100-SXM-80GB": 81559,
    "L4-24GB": 23034,
    "L40S-48GB": 46068,
}
"""Total device memory as ``nvidia-smi`` reports it (MiB), where a recorded figure exists
(source: the totals listed in https://github.com/modal-labs/modal-client/pull/2797)."""


_ENTRIES = [
    # NVIDIA Tesla V100 SXM2 32GB datasheet: 125 TFLOPS tensor (FP16), 15.7 TFLOPS FP32,
    # 900 GB/s HBM2, NVLink 300 GB/s total (150 per direction). No BF16 on Volta.
    _gpu(
        "V100-32GB",
        bf16_tflops=None,
        fp16_tflops=125,
        fp32_tflops=15.7,
        tf32_tflops=None,
        bandwidth_gb_s=900,
        memory_gb=32,
        link_gb_s_per_direction=150,
        link_name="NVLink 2 (300 GB/s bidirectional)",
        vendor="NVIDIA",
        source="https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf",
        aliases=("v100", "v100-sxm2", "v100-32gb", "tesla-v100"),
    ),
    # NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4): BF16/FP16 312 TFLOPS
    # dense (624 sparse), TF32 156, FP32 19.5; 40GB HBM2 1,555 GB/s; NVLink 600 GB/s.
    _gpu(
        "A100-40GB",
        bf16_tflops=312,
        fp16_tflops=312,
        fp32_tflops=19.5,
        tf32_tflops=156,
        bandwidth_gb_s=1555,
        memory_gb=40,
        link_gb_s_per_direction=300,
        link_name="NVLink 3 (600 GB/s bidirectional)",
        vendor="NVIDIA",
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
        aliases=("a100-40gb", "a100-sxm-40gb", "a100-sxm4-40gb"),
    ),
    # Same datasheet, 80GB SXM: HBM2e 2,039 GB/s; compute identical to the 40GB part.
    _gpu(
        "A100-80GB",
        bf16_tflops=312,
        fp16_tflops=312,
        fp32_tflops=19.5,
        tf32_tflops=156,
        bandwidth_gb_s=2039,
        memory_gb=80,
        link_gb_s_per_direction=300,
        link_name="NVLink 3 (600 GB/s bidirectional)",
        vendor="NVIDIA",
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
        aliases=("a100", "a100-80gb", "a100-sxm", "a100-sxm-80gb", "a100-sxm4-80gb"),
    ),
    # NVIDIA H100 datasheet, SXM column: BF16/FP16 1,979 TFLOPS *with sparsity* -> 989.4 dense,
    # TF32 989 sparse -> 494.7 dense, FP32 67; 80GB HBM3 3.35 TB/s; NVLink 900 GB/s.
    _gpu(
        "H100-SXM-80GB",
        bf16_tflops=989.4,
        fp16_tflops=989.4,
        fp32_tflops=67,
        tf32_tflops=494.7,
        bandwidth_gb_s=3350,
        memory_gb=80,
        link_gb_s_per_direction=450,
        link_name="NVLink 4 (900 GB/s bidirectional)",
        vendor="NVIDIA",
        source="https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet",
        aliases=("h100", "h100-sxm", "h100-sxm5", "h100-80gb", "h100-sxm-80gb"),
    ),
    # H800 SXM5: the export variant of the H100 SXM, the same Hopper compute and 80GB HBM3
    # (NVIDIA's H800 SXM5 product brief) with NVLink cut to 400 GB/s bidirectional (200 per
    # direction). DeepSeek-V3 trained on 2048 of them, 8 per node (DeepSeek-V3 technical
    # report, arXiv 2412.19437, section 3.1 "Compute Clusters": "NVLink ... 400 GB/s" inside a
    # node, IB between nodes).
    _gpu(
        "H800-SXM-80GB",
        bf16_tflops=989.4,
        fp16_tflops=989.4,
        fp32_tflops=67,
        tf32_tflops=494.7,
        bandwidth_gb_s=3350,
        memory_gb=80,
        link_gb_s_per_direction=200,
        link_name="NVLink 4, export-limited (400 GB/s bidirectional)",
        vendor="NVIDIA",
        source="https://arxiv.org/abs/2412.19437",
        aliases=("h800", "h800-sxm", "h800-sxm5", "h800-80gb"),
    ),
    # Same datasheet, PCIe column: BF16/FP16 1,513 sparse -> 756 dense, TF32 756 sparse -> 378,
    # FP32 51; 80GB HBM2e 2 TB/s; PCIe Gen5 128 GB/s bidirectional (the optional 2-GPU
    # NVLink bridge is not assumed).
    _gpu(
        "H100-PCIe-80GB",
        bf16_tflops=756,
        fp16_tflops=756,
        fp32_tflops=51,
        tf32_tflops=378,
        bandwidth_gb_s=2000,
        memory_gb=80,
        link_gb_s_per_direction=64,
        link_name="PCIe Gen5 x16 (128 GB/s bidirectional)",
        vendor="NVIDIA",
        source="https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet",
        aliases=("h100-pcie", "h100-pcie-80gb"),
    ),
    # NVIDIA H200 datasheet (SXM): same Hopper compute as H100 SXM (BF16 1,979 sparse -> 989.4
    # dense, FP32 67), 141GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
    _gpu(
        "H200-141GB",
        bf16_tflops=989.4,
        fp16_tflops=989.4,
        fp32_tflops=67,
        tf32_tflops=494.7,
        bandwidth_gb_s=4800,
        memory_gb=141,
        link_gb_s_per_direction=450,
        link_name="NVLink 4 (900 GB/s bidirectional)",
        vendor="NVIDIA",
        source="https://www.nvidia.com/en-us/data-center/h200/",
        aliases=("h200", "h200-sxm", "h200-141gb"),
    ),
    # NVIDIA L4 datasheet: BF16/FP16 242 TFLOPS sparse -> 121 dense, TF32 120 sparse -> 60,
    # FP32 30.3; 24GB GDDR6 300 GB/s; PCIe Gen4 x16 64 GB/s bidirectional.
    _gpu(
        "L4-24GB",
        bf16_tflops=121,
        fp16_tflops=121,
        fp32_tflops=30.3,
        tf32_tflops=60,
        bandwidth_gb_s=300,
        memory_gb=24,
        link_gb_s_per_direction=32,
        link_name="PCIe Gen4 x16 (64 GB/s bidirectional)",
        vendor="NVIDIA",
        source="https://www.nvidia.com/en-us/data-center/l4/",
        aliases=("l4", "l4-24gb"),
    ),
    # NVIDIA L40S datasheet: BF16/FP16 362.05 TFLOPS dense (733 sparse), TF32 183 dense,
    # FP32 91.6; 48GB GDDR6 864 GB/s; PCIe Gen4 x16 64 GB/s bidirectional, no NVLink.
    _gpu(
        "L40S-48GB",
        bf16_tflops=362.05,
        fp16_tflops=362.05,
        fp32_tflops=91.6,
        tf32_tflops=183,
        bandwidth_gb_s=864,
        memory_gb=48,
        link_gb_s_per_direction=32,
        link_name="PCIe Gen4 x16 (64 GB/s bidirectional)",
        vendor="NVIDIA",
        source="https://www.nvidia.com/en-us/data-center/l40s/",
        aliases=("l40s", "l40s-48gb"),
    ),
    # NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090: FP16/BF16 tensor with FP32
    # accumulate 165.2 TFLOPS dense (330.3 with FP16 accumulate), TF32 82.6, FP32 82.6;
    # 24GB GDDR6X 1,008 GB/s; PCIe Gen4 x16, no NVLink.
    _gpu(
        "RTX-4090-24GB",
        bf16_tflops=165.2,
        fp16_tflops=165.2,
        fp32_tflops=82.6,
        tf32_tflops=82.6,
        bandwidth_gb_s=1008,
        memory_gb=24,
        link_gb_s_per_direction=32,
        link_name="PCIe Gen4 x16 (64 GB/s bidirectional)",
        vendor="NVIDIA",
        source="https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf",
        aliases=("rtx4090", "rtx-4090", "4090", "rtx-4090-24gb"),
    ),
    # AMD Instinct MI300X data sheet: peak BF16/FP16 matrix 1,307.4 TFLOPS dense (2,614.9 with
    # sparsity), FP32 163.4 TFLOPS (vector and matrix); 192GB HBM3 5.3 TB/s; 7 Infinity Fabric
    # links of 128 GB/s (bidirectional) -> in the 8-GPU mesh one link (64 GB/s each way) per pair.
    _gpu(
        "MI300X-192GB",
        bf16_tflops=1307.4,
        fp16_tflops=1307.4,
        fp32_tflops=163.4,
        tf32_tflops=None,
        bandwidth_gb_s=5300,
        memory_gb=192,
        link_gb_s_per_direction=64,
        link_name="Infinity Fabric (128 GB/s bidirectional per link)",
        vendor="AMD",
        source="https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf",
        aliases=("mi300x", "mi300x-192gb", "mi300"),
    ),
    # Not a datasheet: a nominal 2-vCPU x86 machine (like the one this project is developed
    # on) so analytic and measured CPU profiles can be compared. 2 cores x 2.6 GHz x 32 FP32
    # FLOP/cycle (two 8-wide AVX2 FMA pipes) = 166 GFLOP/s; ~20 GB/s DRAM per 2 cores;
    # ~10 us per eager aten op (dispatcher + Python). Fit it to a real run with
    # ``autopipe.profiler.analytic.calibrate``.
    DeviceSpec(
        name="cpu",
        peak_flops_per_s={
            "float32": 166e9,
            "bfloat16": 166e9,
            "float16": 166e9,
        },
        memory_bandwidth_bytes_per_s=20 * GB,
        memory_bytes=16 * 10**9,
        link_bandwidth_bytes_per_s=10 * GB,
        link_name="shared memory (nominal)",
        kernel_launch_overhead_s=10e-6,
        compute_efficiency=0.5,
        memory_efficiency=0.5,
        vendor="generic",
        source="nominal, not a datasheet (see comment in catalog.py)",
        aliases=("cpu-nominal",),
    ),
]

_INTER_NODE = {
    # DGX-1 (V100): four 100 Gb/s EDR InfiniBand adapters for eight GPUs -> 50 Gb/s = 6.25 GB/s
    # per GPU and direction.
    "V100-32GB": (
        6.25,
        "InfiniBand EDR, 4 x 100 Gb/s per 8 GPUs",
        "https://docs.nvidia.com/dgx/dgx1-user-guide/introduction-to-dgx1.html",
    ),
    # DGX A100: eight single-port ConnectX-6 200 Gb/s HDR InfiniBand adapters, one per GPU.
    "A100-40GB": (
        25,
        "InfiniBand HDR, 200 Gb/s per GPU",
        "https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html",
    ),
    "A100-80GB": (
        25,
        "InfiniBand HDR, 200 Gb/s per GPU",
        "https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html",
    ),
    # DGX H100 / H200: eight ConnectX-7 400 Gb/s NDR InfiniBand ports, one per GPU.
    "H100-SXM-80GB": (
        50,
        "InfiniBand NDR, 400 Gb/s per GPU",
        "https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html",
    ),
    # DeepSeek-V3's H800 nodes: one 400 Gb/s InfiniBand (CX7) adapter per GPU (DeepSeek-V3
    # technical report, arXiv 2412.19437, section 3.1; ~50 GB/s, its section 3.2.2).
    "H800-SXM-80GB": (
        50,
        "InfiniBand NDR (CX7), 400 Gb/s per GPU",
        "https://arxiv.org/abs/2412.19437",
    ),
    "H200-141GB": (
        50,
        "InfiniBand NDR, 400 Gb/s per GPU",
        "https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html",
    ),
}
"""Inter-node bandwidth per GPU and direction (GB/s), link, source: the platforms' network
adapters (the PCIe cards and the MI300X have no one platform: 0, give the figure)."""

_ENTRIES = [
    dataclasses.replace(
        spec,
        inter_node_bandwidth_bytes_per_s=_INTER_NODE[spec.name][0] * GB,
        inter_node_link_name=_INTER_NODE[spec.name][1],
        inter_node_source=_INTER_NODE[spec.name][2],
    )
    if spec.name in _INTER_NODE
    else spec
    for spec in _ENTRIES
]
_ENTRIES = [
    dataclasses.replace(spec, memory_bytes=REPORTED_MIB[spec.name] * 2**20)
    if spec.name in REPORTED_MIB
    else spec
    for spec in _ENTRIES
]

_FP8_TFLOPS = {
    # Dense FP8 tensor-core peaks (the datasheets' "with sparsity" figures halved): H100 SXM
    # 3,958 -> 1,979; H100 PCIe 3,026 -> 1,513; H200 as H100 SXM; L4 485 -> 242.5; L40S
    # 1,466 -> 733 (sources: each entry's datasheet above). Used by ``precision="fp8"``.
    "H100-SXM-80GB": 1979.0,
    "H100-PCIe-80GB": 1513.0,
    "H200-141GB": 1979.0,
    "L4-24GB": 242.5,
    "L40S-48GB": 733.0,
}
_ENTRIES = [
    dataclasses.replace(
        spec,
        peak_flops_per_s={**spec.peak_flops_per_s, "float8": _FP8_TFLOPS[spec.name] * TERA},
    )
    if spec.name in _FP8_TFLOPS
    else spec
    for spec in _ENTRIES
]
_ENTRIES.append(
    # torchtitan's benchmark GPU (Meta's Grand Teton): "H100 GPU equipped with 96GB HBM2e with
    # 2.4 TB/sec peak memory bandwidth", "default 500W power limit", 400 Gb/s RDMA per GPU
    # (torchtitan benchmarks/llama3_h100_202412_torchtitan.md). Its footnote: "the actual peak
    # TFLOPs number is between SXM and NVL, and we don't know its exact value": the midpoint of
    # H100 NVL's dense 835 (BF16) / 1,671 (FP8) and SXM's 989.4 / 1,979 TFLOP/s is taken.
    # NVLink 4 as SXM. Memory 96 GB decimal (no reported MiB total recorded).
    DeviceSpec(
        name="H100-96GB-HBM2e-500W",
        peak_flops_per_s={
            "bfloat16": 912.2 * TERA,
            "float16": 912.2 * TERA,
            "float8": 1825.0 * TERA,
            "float32": 63.0 * TERA,
            "tfloat32": 456.1 * TERA,
        },
        memory_bandwidth_bytes_per_s=2400 * GB,
        memory_bytes=96 * 10**9,
        link_bandwidth_bytes_per_s=450 * GB,
        link_name="NVLink 4 (900 GB/s bidirectional)",
        vendor="NVIDIA",
        source="https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md",
        aliases=("h100-96gb", "h100-hbm2e", "h100-96gb-hbm2e-500w", "grand-teton-h100"),
        inter_node_bandwidth_bytes_per_s=50 * GB,
        inter_node_link_name="RDMA 400 Gb/s per GPU",
        inter_node_source="https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md",
    )
)

OVERLAP_COMPUTE_LOSS = 0.1
"""While NCCL overlaps a GEMM it runs its own kernels on some of the GPU's SMs (one per
channel; Megatron's --tp-comm-overlap configurations give communication from 1 to 32 of an
H100's 132 SMs) and shares its memory bandwidth: an assumed 10% of the overlapped
collective's time is lost to compute. Not measured here."""
_COLLECTIVE_LATENCY_S = (3.4e-6, 14e-6, 8.4e-6)
"""Per ring step inside a node (an NVLink hop), per step across nodes (a network hop), and once
per collective: NCCL's own tuning model for its Simple protocol, the one bandwidth-bound
messages run with (NVIDIA/nccl src/graph/tuning.cc at 5067397c: ``hwLatencies[NVLINK][RING]``
3.4 us, ``hwLatencies[NET][RING]`` 14 us, ``baseLatencies[RING]`` 8.4 us; the planner's use of
them: ``autopipe.planner.nccl``). NCCL's figures, not a measurement of these GPUs."""
_ENTRIES = [
    dataclasses.replace(
        spec,
        collective_latency_s=_COLLECTIVE_LATENCY_S[0],
        inter_node_collective_latency_s=_COLLECTIVE_LATENCY_S[1],
        collective_base_latency_s=_COLLECTIVE_LATENCY_S[2],
        overlap_compute_loss=OVERLAP_COMPUTE_LOSS,
    )
    if spec.name.startswith(("A100", "H100-SXM", "H100-96GB", "H200"))
    else spec
    for spec in _ENTRIES
]

CATALOG: dict[str, DeviceSpec] = {spec.name: spec for spec in _ENTRIES}
"""Built-in specs by canonical name."""


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def _alias_table() -> dict[str, str]:
    table: dict[str, str] = {}
    for spec in CATALOG.values():
        for alias in (spec.name, *spec.aliases):
            table[_key(alias)] = spec.name
    return table


def device_names() -> list[str]:
    """Canonical names of the built-in specs, in catalog order."""
    return list(CATALOG)


def is_catalog_device(name: str) -> bool:
    """True if ``name`` is a built-in spec or alias (analytic), False otherwise (e.g. ``"cuda"``,
    which the CLI measures on)."""
    return _key(str(name)) in _alias_table()


def get_device(name: str | DeviceSpec) -> DeviceSpec:
    """Look up a built-in spec by name or alias, case-insensitively (``"h100-sxm"``, ``"A100"``).

    A :class:`DeviceSpec` is returned unchanged. Raises :class:`DeviceSpecError` listing the
    valid names for an unknown one.
    """
    if isinstance(name, DeviceSpec):
        return name
    canonical = _alias_table().get(_key(str(name)))
    if canonical is None:
        raise DeviceSpecError(
            f"unknown device {name!r}; built-in devices: {', '.join(device_names())} "
            "(or pass a spec file with --device-spec)"
        )
    return CATALOG[canonical]


def parse_device_counts(text: str) -> list[tuple[str, int]]:
    """``"a100-80gb:4,v100-32gb:4"`` -> ``[("a100-80gb", 4), ("v100-32gb", 4)]``: device names in
    pipeline order with their counts (a missing count is 1), not yet looked up.

    Raises :class:`DeviceListError` on an empty name or a count that is not an integer >= 1.
    """
    out = []
    for part in text.split(","):
        name, _, count = part.strip().partition(":")
        try:
            n = int(count) if count else 1
        except ValueError:
            n = 0
        if not name or n < 1:
            raise DeviceListError(
                f"{text!r}: expected NAME[:COUNT],... in pipeline order, e.g. "
                "a100-80gb:4,v100-32gb:4"
            )
        out.append((name, n))
    return out


def parse_device_list(text: str) -> list[tuple[DeviceSpec, int]]:
    """``"a100-80gb:4,v100-32gb:4"`` -> the built-in specs with their counts, in pipeline order.

    The whole list is checked for form before any name is looked up, so a malformed list is
    reported as such (:class:`DeviceListError`); an unknown name raises
    :class:`DeviceSpecError` listing the valid ones.
    """
    return [(get_device(name), count) for name, count in parse_device_counts(text)]


_REQUIRED = (
    "name",
    "peak_flops_per_s",
    "memory_bandwidth_bytes_per_s",
    "memory_bytes",
    "link_bandwidth_bytes_per_s",
)
_FLOAT_FIELDS = (
    "memory_bandwidth_bytes_per_s",
    "link_bandwidth_bytes_per_s",
    "inter_node_bandwidth_bytes_per_s",
    "link_latency_s",
    "collective_latency_s",
    "inter_node_collective_latency_s",
    "collective_base_latency_s",
    "overlap_compute_loss",
    "kernel_launch_overhead_s",
    "compute_efficiency",
    "memory_efficiency",
)


def device_spec_from_dict(data: Any, origin: str = "device spec") -> DeviceSpec:
    """Build a spec from plain data; ``base: a100-80gb`` inherits missing fields from a built-in.

    The format is docs/devices.md's (an example: examples/device-spec.yaml). Quantities are
    written as the CLI's flags take them: sizes as YAML/JSON numbers or strings with a unit
    (``memory_bytes: 48GiB`` as ``--memory 48GiB``; ``80GB``, ``48e9``), bandwidths likewise
    with an optional ``/s`` (``link_bandwidth_bytes_per_s: 900GB/s``), other numbers plain
    or as strings (``"312e12"``). Every bad field is reported at once: one
    :class:`DeviceSpecError` naming each, not one per try.
    """
    if not isinstance(data, dict):
        raise DeviceSpecError(f"{origin}: expected a mapping of fields, got {type(data).__name__}")
    problems: list[str] = []
    merged = _merged_fields(dict(data), origin, problems)
    _parse_peaks(merged, problems)
    _parse_quantities(merged, problems)
    problems += _range_problems(merged)
    if problems:
        raise _spec_error(origin, problems)
    merged["memory_bytes"] = int(merged["memory_bytes"])
    if "gpus_per_node" in merged:
        merged["gpus_per_node"] = int(merged["gpus_per_node"])
    return DeviceSpec(**merged)


def _merged_fields(data: dict[str, Any], origin: str, problems: list[str]) -> dict[str, Any]:
    """``data``'s fields over its ``base`` device's, the unknown ones dropped; what is
    unknown, missing or a bad base goes to ``problems``."""
    base_name = data.pop("base", None)
    merged: dict[str, Any] = {}
    if base_name:
        try:
            merged = get_device(str(base_name)).to_dict()
        except DeviceSpecError as exc:
            problems.append(f"base: {exc}")
        else:
            merged["aliases"] = []
            merged["source"] = f"{origin} (based on {merged['name']})"
    merged.update(data)
    known = {f.name for f in dataclasses.fields(DeviceSpec)}
    unknown = sorted(map(str, set(merged) - known))
    if unknown:
        problems.append(
            f"unknown field(s) {', '.join(unknown)} (valid fields: base, {', '.join(sorted(known))})"
        )
        for name in set(merged) - known:
            del merged[name]
    missing = [f for f in _REQUIRED if f not in merged]
    if missing:
        problems.append(
            f"missing required field(s) {', '.join(missing)} (required: {', '.join(_REQUIRED)}, "
            "or base: a catalog device to start from)"
        )
    return merged


def _parse_peaks(merged: dict[str, Any], problems: list[str]) -> None:
    """``peak_flops_per_s`` (if given) as normalized dtype -> FLOP/s, in place."""
    peaks = merged.get("peak_flops_per_s")
    if "peak_flops_per_s" not in merged:
        return
    if not isinstance(peaks, dict) or not peaks:
        problems.append(
            "peak_flops_per_s must map dtypes to FLOP/s, e.g. {bfloat16: 312e12, float32: 19.5e12}"
        )
        return
    merged["peak_flops_per_s"] = {}
    for key, value in peaks.items():
        try:
            dtype = normalize_dtype(key)
        except DeviceSpecError as exc:
            problems.append(f"peak_flops_per_s: {exc}")
            continue
        merged["peak_flops_per_s"][dtype] = _quantity(value, f"peak_flops_per_s.{key}", problems)


def _parse_quantities(merged: dict[str, Any], problems: list[str]) -> None:
    """The numeric fields as numbers (a unit allowed), the name and aliases as text, in place."""
    for name in _FLOAT_FIELDS:
        if name in merged:
            merged[name] = _quantity(merged[name], name, problems)
    if "memory_bytes" in merged:
        merged["memory_bytes"] = _quantity(merged["memory_bytes"], "memory_bytes", problems)
    if "gpus_per_node" in merged:
        merged["gpus_per_node"] = _quantity(merged["gpus_per_node"], "gpus_per_node", problems)
    merged["aliases"] = tuple(str(a) for a in merged.get("aliases", ()))
    if "name" in merged:
        merged["name"] = str(merged["name"])


def _spec_error(origin: str, problems: list[str]) -> DeviceSpecError:
    """One error naming every problem of a spec, on one line."""
    if len(problems) == 1:
        return DeviceSpecError(f"{origin}: {problems[0]}")
    listed = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
    return DeviceSpecError(f"{origin}: {len(problems)} problems: {listed}")


def load_device_spec(path: str | Path) -> DeviceSpec:
    """Read a spec from a ``.yaml``/``.yml`` or ``.json`` file (see :func:`device_spec_from_dict`)."""
    path = Path(path)
    if is_named_pipe(path):  # read_text would wait, forever if no process writes it
        raise DeviceSpecError(f"{path}: a named pipe, not a file; give a YAML or JSON file")
    try:
        text = path.read_text()
    except OSError as exc:
        raise DeviceSpecError(f"cannot read device spec {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise DeviceSpecError(f"{path}: not a text file ({exc.reason}); give YAML or JSON") from exc
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DeviceSpecError(
                f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})"
            ) from exc
    else:
        import yaml  # pyyaml is a declared dependency; imported lazily to keep startup light

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise DeviceSpecError(f"{path}: not valid YAML ({exc})".replace("\n", " ")) from exc
    return device_spec_from_dict(data, origin=str(path))


def _quantity(value: Any, name: str, problems: list[str]) -> float | None:
    """``value`` of field ``name`` as a number: plain, a numeric string, or, for a size
    (``*_bytes``) or a bandwidth (``*_bytes_per_s``), a string with a unit as the flags take
    it (``parse_bytes``: ``48GiB``, ``80GB``; a bandwidth as ``parse_bandwidth`` reads it:
    ``900GB/s`` bytes, ``400Gb/s`` bits, an ambiguous ``gb`` refused). A bad value
    is appended to ``problems`` and None returned."""
    if isinstance(value, bool):  # YAML's yes/no: a number by accident
        problems.append(f"{name} must be a number, got {value!r}")
        return None
    if isinstance(value, (int, float)):
        return float(value)
    sized = name.endswith(("_bytes", "_bytes_per_s"))
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
        try:
            if name.endswith("_bytes_per_s"):
                return parse_bandwidth(value)
            if sized:
                return float(parse_bytes(value.strip()))
        except ValueError as exc:
            if name.endswith("_bytes_per_s"):
                problems.append(f"{name}: {exc}")
                return None
    example = (
        "900GB/s or 9e11"
        if name.endswith("_bytes_per_s")
        else "48GiB, 80GB or 48e9"
        if sized
        else "312e12"
        if name.startswith("peak_flops_per_s")
        else "0.7"
    )
    kind = "a bandwidth" if name.endswith("_bytes_per_s") else "a size" if sized else "a number"
    problems.append(f"{name} must be {kind}, e.g. {example}, got {value!r}")
    return None


def _validate(spec: DeviceSpec, origin: str) -> None:
    problems = _range_problems(dataclasses.asdict(spec))
    if problems:
        raise _spec_error(origin, problems)


def _range_problems(fields: dict[str, Any]) -> list[str]:
    """What is out of range among a spec's ``fields`` (values that failed to parse are None
    and skipped: they are reported already)."""
    peaks = fields.get("peak_flops_per_s")
    positive = {
        name: fields.get(name)
        for name in ("memory_bandwidth_bytes_per_s", "memory_bytes", "link_bandwidth_bytes_per_s")
    }
    if isinstance(peaks, dict):
        positive.update({f"peak_flops_per_s.{k}": v for k, v in peaks.items()})
    problems = [
        f"{name} must be positive, got {value!r}"
        for name, value in positive.items()
        if value is not None and not value > 0  # also rejects NaN
    ]
    for name in ("compute_efficiency", "memory_efficiency"):
        value = fields.get(name, 1.0)
        if value is not None and not 0 < value <= 1:
            problems.append(f"{name} must be in (0, 1], got {value!r}")
    count = fields.get("gpus_per_node", 1)
    if count is not None and not (1 <= count < math.inf and count == int(count)):
        problems.append(f"gpus_per_node must be a whole number >= 1, got {count!r}")
    inter = fields.get("inter_node_bandwidth_bytes_per_s", 0.0)
    if inter is not None and not inter >= 0:  # also rejects NaN
        problems.append(f"inter_node_bandwidth_bytes_per_s must be >= 0, got {inter!r}")
    for name in ("kernel_launch_overhead_s", "link_latency_s"):
        value = fields.get(name, 0.0)
        if value is not None and not value >= 0:  # also rejects NaN
            problems.append(f"{name} must be >= 0, got {value!r}")
    return problems


def format_catalog(specs: Iterable[DeviceSpec] | None = None) -> str:
    """A plain-text table of device specs (default: the built-in catalog) for ``autopipe devices``."""
    rows = [
        [
            "device",
            "bf16 TFLOP/s",
            "fp16 TFLOP/s",
            "fp32 TFLOP/s",
            "memory GB",
            "mem GB/s",
            "link GB/s/dir",
            "link",
            "aliases",
        ]
    ]
    for spec in CATALOG.values() if specs is None else specs:
        peaks = spec.peak_flops_per_s

        def tflops(key: str, peaks: dict[str, float] = peaks) -> str:
            return f"{peaks[key] / TERA:g}" if key in peaks else "-"

        rows.append(
            [
                spec.name,
                tflops("bfloat16"),
                tflops("float16"),
                tflops("float32"),
                f"{spec.memory_bytes / GB:g}",
                f"{spec.memory_bandwidth_bytes_per_s / GB:g}",
                f"{spec.link_bandwidth_bytes_per_s / GB:g}",
                spec.link_name,
                ", ".join(spec.aliases),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("dense peaks (no sparsity); link bandwidth per direction; sources in catalog.py")
    return "\n".join(lines)
