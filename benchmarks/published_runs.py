"""autopipe's cost model against published GPU training runs.

Each run below is a training configuration somebody ran and published, with its source (the
paper's table or the repository's document and the row). The run is forced to its published
configuration through autopipe's planner (``PlanRequest``: GPUs, tensor parallelism T, data
parallelism D and the sharding of the training state, pipeline stages PP = N / (T D), the
schedule, micro-batches, global batch, re-materialization), priced, and compared with the
published throughput (tokens/s per GPU) and, where published, peak memory per GPU:

    .venv/bin/python benchmarks/published_runs.py [--only KEY,...] [--search]

One line per run: ``predicted / published`` tokens/s per GPU and memory, then a summary line
(how many within 15% and 20%, median, range). A run the planner cannot express (a feature it
lacks: context parallelism, FP8 matmuls, ...) is listed with the missing feature, never priced
as something else. ``--search`` also runs the auto mesh search on each priced run and prints
its pick beside the published configuration.

Profiles are closed-form (:func:`transformer_profile`), torch-free: one unit per transformer
block plus the embedding and the head, each unit's FLOPs and bytes counted from the
architecture and priced on the catalog GPU as the analytic profiler prices ops (matmul FLOPs at
the GPU's peak times its matmul efficiency, memory-bound element-wise passes at its memory
bandwidth times its memory efficiency). Deterministic: the same figures on any machine.

Published throughput where a paper gives TFLOP/s per GPU instead of tokens: converted to
tokens/s per GPU with that paper's own FLOP count (``flops_per_token`` of each source, stated
beside it), so the comparison is with what the run did, not with autopipe's count.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import queue as queue_module
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autopipe.planner import PlanningError, plan  # noqa: E402
from autopipe.planner.errors import RuleViolation  # noqa: E402

from autopipe.core.attention import DEFAULT_KERNEL, attention_efficiency, kernel_for_trainer  # noqa: E402
from autopipe.core.catalog import DeviceSpec, get_device, is_catalog_device  # noqa: E402
from autopipe.core.cluster import Cluster, Device  # noqa: E402
from autopipe.core.gemm import gemm_s  # noqa: E402
from autopipe.core.plan import Plan  # noqa: E402
from autopipe.core.profile import Profile, UnitProfile  # noqa: E402
from autopipe.core.request import PlanRequest  # noqa: E402

GIB = 2**30
BF16 = 2
"""Bytes per bf16 element: weights, activations and gradients of every run below."""


@dataclass(frozen=True)
class Arch:
    """A decoder-only transformer: ``gated`` is a SwiGLU MLP (three matrices, Llama) else a
    GELU MLP (two, GPT); ``tied``: the output head shares the embedding (GPT, BLOOM), which
    Megatron keeps a copy of on the first and the last stage; ``dropout``: GPT-style dropout
    masks are saved for backward."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated: bool
    tied: bool = False
    dropout: bool = False

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    @property
    def block_parameters(self) -> int:
        h = self.hidden
        return h * (h + 2 * self.kv_dim) + h * h + (3 if self.gated else 2) * h * self.ffn + 2 * h

    @property
    def parameters(self) -> int:
        head = 0 if self.tied else self.vocab * self.hidden
        return self.layers * self.block_parameters + self.vocab * self.hidden + head


LLAMA31_8B = Arch("llama3.1-8b", 32, 4096, 32, 8, 14336, 128256, gated=True)
LLAMA31_70B = Arch("llama3.1-70b", 80, 8192, 64, 8, 28672, 128256, gated=True)
LLAMA31_405B = Arch("llama3.1-405b", 126, 16384, 128, 8, 53248, 128256, gated=True)
# Llama 2 as torchtitan 157a12c56 builds it (torchtitan/models/llama/__init__.py
# llama2_configs, the Llama 2 tokenizer's 32,000 words): 13B h 5120, 40 heads, FFN 13,824
# (multiple_of 256); 70B as Llama 3 70B's shape with the smaller vocabulary.
LLAMA2_13B = Arch("llama2-13b", 40, 5120, 40, 40, 13824, 32000, gated=True)
LLAMA2_70B = Arch("llama2-70b", 80, 8192, 64, 8, 28672, 32000, gated=True)


def _gpt(
    name: str, layers: int, hidden: int, heads: int, vocab: int, dropout: bool, tied: bool = True
) -> Arch:
    return Arch(name, layers, hidden, heads, heads, 4 * hidden, vocab, gated=False, tied=tied,
                dropout=dropout)  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One published run: the configuration as published and what it reached."""

    key: str
    source: str
    """Where the figures are: the document or paper, its table, the row."""
    arch: Arch
    seq: int
    gpu: str
    """The GPU as the source names it (a catalog name where the catalog has it)."""
    gpus: int
    tp: int
    pp: int
    dp: int
    global_batch: int
    published_tokens_per_gpu_s: float
    microbatch: int | None = None
    """Sequences per micro-batch; None: not published (autopipe then picks M)."""
    shard: str = "none"
    """How the training state is sharded over D: none, optimizer (ZeRO-1 / distributed
    optimizer), gradients, parameters (ZeRO-3 / FSDP)."""
    recompute: str = "none"
    """none, full (every layer re-computed) or selective (torchtitan's ``selective`` AC,
    Megatron's ``--recompute-granularity selective``)."""
    precision: str = "bf16"
    """bf16 or fp8 (matmuls in FP8: torchtitan's Float8, Megatron's ``--fp8-format``)."""
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = True
    compiled: bool = False
    """torch.compile (or fused kernels): element-wise ops fused with their neighbours."""
    flash: bool = True
    """Flash attention (no saved scores, causal FLOPs halved); False: the 2021 math path."""
    tp_overlap: bool = False
    """TP collectives overlapped with compute (torchtitan's async TP, ``--tp-comm-overlap``)."""
    grad_overlap: bool = False
    """Gradient reduce-scatter overlapped with backward (``--overlap-grad-reduce``)."""
    fsdp_under_pp: bool = False
    """torchtitan's FSDP2 with pipeline parallelism: parameters and gradients stay unsharded
    across micro-batches (``reshard_after_forward=False``)."""
    grad_reduce_fp32: bool = False
    """Gradients reduced in fp32 over the data-parallel group: torchtitan's FSDP2 mixed
    precision (``mixed_precision_reduce = "float32"``, the only choice its 9dec370 config
    manager offers), Megatron-LM with ``--bf16`` (``arguments.py`` turns
    ``--accumulate-allreduce-grads-in-fp32`` on for bfloat16), the Llama 3 paper's FSDP
    (section 3.3.2: gradients reduce-scattered in FP32). False where the run reduced in its
    16-bit dtype (SC21's fp16 Megatron). BLOOM's DeepSpeed ``BF16_Optimizer`` reduces its fp32
    gradient copy (``get_grads_for_reduction``: ``fp32_groups_gradients_flat``)."""
    fp32_grad_buffer: bool = False
    """DeepSpeed's ``BF16_Optimizer`` (BLOOM: ``ZERO_STAGE=0 # important: bf16 must use z0! it
    implements its own zero stage 1 equivalent``, tr11-176B-ml.slurm): an fp32 copy of every
    gradient beside the bf16 one (deepspeed/runtime/bf16_optimizer.py,
    ``fp32_groups_gradients_flat``; the pipeline engine calls ``update_hp_grads(
    clear_lp_grads=False)``)."""
    cp: int = 1
    """Context-parallel degree."""
    fused_norm: bool = False
    """torchtitan's ``fused_rmsnorm`` Triton kernels in place of its eager RMSNorm (its April
    2024 configs' ``norm_type``; :data:`TORCHTITAN_FUSED_NORM_EAGER_BYTES_PER_TOKEN`)."""
    published_memory_gib: float | None = None
    inter_node_bandwidth_bytes_per_s: float | None = None
    """Where the run's cluster differs from the catalog GPU's platform."""
    note: str = ""


# ----- published throughput conversions (each source's own FLOP count) -----


def megatron_sc21_flops_per_token(a: Arch, seq: int) -> float:
    """Narayanan et al. SC21 (arXiv 2104.04473), appendix: ``96 B s l h^2 (1 + s / (6h) +
    V / (16 l h))`` FLOPs per iteration with activation recomputation, per token."""
    h, l_ = a.hidden, a.layers
    return 96 * l_ * h * h * (1 + seq / (6 * h) + a.vocab / (16 * l_ * h))


def megatron_core_flops_per_token(a: Arch, seq: int) -> float:
    """Megatron-LM's ``num_floating_point_operations`` (2024), per token, no recomputation:
    ``12 l h^2 ((1 + kv/heads + s/h) + ffn/h x (3/2 if gated) + V / (2 l h))``."""
    h, l_ = a.hidden, a.layers
    gated = 1.5 if a.gated else 1.0
    return (
        12
        * l_
        * h
        * h
        * ((1 + a.kv_heads / a.heads + seq / h) + a.ffn / h * gated + a.vocab / (2 * l_ * h))
    )


def _tokens(tflops: float, flops_per_token: float) -> float:
    return tflops * 1e12 / flops_per_token


TT = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (= arXiv 2410.06511 section 4)"
TT_ASYNC = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
TT_A100 = "torchtitan docs/performance.md at 157a12c56 (2024-04-24), 64 A100 (80GB), FSDP2"
TT_A100_ROWS = [
    # (model, arch, seq, local batch, AC, WPS): the tables' rows torchtitan's train.py logged
    # (wps: tokens / s / model-parallel size, here per GPU). Its two "selective layer" rows (8B
    # 2904, 13B 1914) are left out: the layer frequency (``selective_ac_option``) they used
    # is not stated, and the configs' own is "op".
    ("l3-8b", LLAMA31_8B, 8192, 1, "selective", 2973),
    ("l3-70b", LLAMA31_70B, 8192, 1, "full", 331),
    ("l2-13b", LLAMA2_13B, 4096, 2, "none", 2162),
    ("l2-13b", LLAMA2_13B, 4096, 2, "selective", 1904),
    ("l2-70b", LLAMA2_70B, 4096, 1, "selective", 355),
    ("l2-70b", LLAMA2_70B, 4096, 2, "full", 353),
]
"""torchtitan's first published runs (train_configs/llama3_8b.toml ... at 157a12c56): FSDP2 over
all 64 GPUs (bf16 parameters, fp32 reduction, each block resharded after its forward), no
``torch.compile``, ``norm_type = "fused_rmsnorm"``, SDPA's flash attention, selective AC the
``op`` policy (its code as at 9dec370: every other ``mm`` and SDPA kept). Llama 3 at sequence
8192, Llama 2 at 4096. The cluster's network is not stated: the catalog's A100 platform (a DGX
A100's 200 Gb/s HDR adapter per GPU). No memory published."""
H100_96 = "H100-96GB-HBM2e-500W"
"""torchtitan's Grand Teton H100: 96 GB HBM2e, 2.4 TB/s, 500 W, 400 Gb/s RDMA per GPU."""

MCORE = "Megatron-LM README.md, images/model_table.png (Megatron-Core weak scaling, 2024, H100)"
MCORE_ARCHS = [
    # (size, heads, hidden, layers, TP, PP, DP, GPUs, batch, per-GPU TFLOP/s)
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9),
]
"""The table's rows; vocabulary 131072, sequence 4096 (the README's benchmark configuration),
with the DP, TP and PP overlaps on (--overlap-grad-reduce, --overlap-param-gather,
--tp-comm-overlap) and BF16 (MFU = TFLOP/s / 989)."""

SC21 = "Narayanan et al. SC21, arXiv 2104.04473, Table 1 (= Megatron-LM README 2021, cases_april2021.png)"
SC21_SCRIPT = "Megatron-LM examples/sc21/run_table_1.sh"
SC21_ARCHS = [
    # (size, heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU, micro-batch,
    #  layers per virtual stage (0: plain 1F1B), torch DDP)
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, 0, True),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16, 0, True),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16, 0, True),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 0, True),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 0, False),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5, False),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5, False),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3, False),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1, False),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 0, False),
]
"""Vocabulary 51200, sequence 2048, A100-80GB (Selene: DGX A100, 8 x 200 Gb/s HDR per node),
mixed precision, activation recomputation (the paper's FLOP count includes it), Megatron of
2021: tensor parallelism without sequence parallelism, no flash attention. The table gives the
mesh and the batch; the rest is the authors' own script for it, Megatron-LM
``examples/sc21/run_table_1.sh`` (``MBS``, ``--num-layers-per-virtual-pipeline-stage``,
``--recompute-method uniform``, ``DDP``): the micro-batch size, the interleaved schedule where it
names layers per virtual stage (V = layers / (PP x that)), and the data-parallel wrapper: torch's
``DistributedDataParallel`` (``DDP=torch``, up to 18B), which all-reduces gradient buckets as the
backward produces them, or Megatron's own (``DDP=local``), which all-reduces after the backward."""


def _runs() -> list[Run]:
    out: list[Run] = []
    # torchtitan, Table 1 (8 GPUs) and Table 3 (128 GPUs): Llama 3.1 8B, FSDP, local batch 2,
    # seq 8192 (torchtitan's llama3 8B config), selective (op) activation checkpointing.
    for table, gpus, rows in (
        (1, 8, [("", 5762, 82.4, False, "bf16"), ("compile", 6667, 77.0, True, "bf16"),
                ("compile-fp8", 8532, 76.8, True, "fp8")]),
        (3, 128, [("", 5605, 67.0, False, "bf16"), ("compile", 6514, 62.0, True, "bf16"),
                  ("compile-fp8", 8380, 61.8, True, "fp8")]),
    ):  # fmt: skip
        for tag, tps, mem, compiled, prec in rows:
            out.append(Run(
                key=f"tt-8b-{gpus}gpu{('-' + tag) if tag else ''}",
                source=f"{TT}, Table {table}, row {'FSDP' + (' + torch.compile' if compiled else '') + (' + Float8' if prec == 'fp8' else '')}",
                arch=LLAMA31_8B, seq=8192, gpu=H100_96, gpus=gpus, tp=1, pp=1, dp=gpus,
                global_batch=2 * gpus, microbatch=2, shard="parameters", recompute="selective",
                precision=prec, compiled=compiled, published_tokens_per_gpu_s=tps,
                published_memory_gib=mem,
            ))  # fmt: skip
    # Table 4: Llama 3.1 70B, 256 GPUs, FSDP 32 x TP 8, local batch 16, full AC, compile, Float8.
    for tag, tps, mem, overlap in (("", 829, 71.9, False), ("asynctp", 876, 67.6, True)):
        out.append(Run(
            key=f"tt-70b-256gpu{('-' + tag) if tag else ''}",
            source=f"{TT}, Table 4, row {'2D + AsyncTP' if overlap else '2D'}",
            arch=LLAMA31_70B, seq=8192, gpu=H100_96, gpus=256, tp=8, pp=1, dp=32,
            global_batch=512, microbatch=16, shard="parameters", recompute="full",
            precision="fp8", compiled=True, tp_overlap=overlap, published_tokens_per_gpu_s=tps,
            published_memory_gib=mem,
        ))  # fmt: skip
    # Table 5: Llama 3.1 405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, local batch 32 (global 256),
    # full AC, compile, Float8, async TP. Micro-batches not in the table: torchtitan's default,
    # as many as the PP degree (9dec370, torchtitan/parallelisms/pipelining_utils.py:
    # ``n_microbatches = ... or pipeline_parallel_degree``), so M = 8 of 4 sequences.
    for sched, v, tps, mem in (("1f1b", 1, 100, 82.5), ("interleaved-1f1b", 2, 128, 72.7)):
        out.append(Run(
            key=f"tt-405b-512gpu-{sched}",
            source=f"{TT}, Table 5, row {'1F1B' if v == 1 else 'Interleaved 1F1B'}",
            arch=LLAMA31_405B, seq=8192, gpu=H100_96, gpus=512, tp=8, pp=8, dp=8,
            global_batch=256, microbatch=32 // 8, shard="parameters", recompute="full",
            precision="fp8", compiled=True, tp_overlap=True, fsdp_under_pp=True,
            schedule=sched, virtual_stages=v, published_tokens_per_gpu_s=tps,
            published_memory_gib=mem,
        ))  # fmt: skip
    # Tables 2 and 6: context parallelism (FSDP over dp_shard x cp, as torchtitan runs it).
    for fsdp, cp, seq, tps, mem in ((8, 1, 32768, 3890, 83.9), (4, 2, 65536, 2540, 84.2),
                                    (2, 4, 131072, 1071, 84.0), (1, 8, 262144, 548, 84.5)):  # fmt: skip
        out.append(Run(
            key=f"tt-8b-8gpu-cp{cp}-seq{seq // 1024}k",
            source=f"{TT}, Table 2, row FSDP {fsdp}, CP {cp}",
            arch=LLAMA31_8B, seq=seq, gpu=H100_96, gpus=8, tp=1, pp=1, dp=fsdp, cp=cp,
            global_batch=fsdp, microbatch=1, shard="parameters", recompute="full",
            precision="fp8", compiled=True, published_tokens_per_gpu_s=tps,
            published_memory_gib=mem,
        ))  # fmt: skip
    for fsdp, cp, seq, tps, mem in ((8, 1, 32768, 76, 75.3), (4, 2, 65536, 47, 75.9),
                                    (2, 4, 131072, 31, 77.1), (1, 8, 262144, 16, 84.9)):  # fmt: skip
        out.append(Run(
            key=f"tt-405b-512gpu-cp{cp}-seq{seq // 1024}k",
            source=f"{TT}, Table 6, row FSDP {fsdp}, CP {cp}",
            arch=LLAMA31_405B, seq=seq, gpu=H100_96, gpus=512, tp=8, pp=8, dp=fsdp, cp=cp,
            global_batch=8 * fsdp, microbatch=1, shard="parameters", recompute="full",
            precision="fp8", compiled=True, tp_overlap=True, fsdp_under_pp=True,
            published_tokens_per_gpu_s=tps, published_memory_gib=mem,
        ))  # fmt: skip
    # torchtitan async TP benchmark (June 2025): vanilla vs async TP, bf16 and float8 tensorwise.
    for arch, gpus, dp, lbs, ac, rows in (
        (LLAMA31_70B, 256, 32, 16, "full", [("bf16", 597.3, 652.4), ("fp8", 809.8, 942.4)]),
        (LLAMA31_8B, 64, 8, 12, "selective", [("bf16", 4378, 4809.4), ("fp8", 5078.1, 5570.1)]),
    ):
        size = "70b" if arch is LLAMA31_70B else "8b"
        for prec, vanilla, async_ in rows:
            for overlap, tps in ((False, vanilla), (True, async_)):
                out.append(Run(
                    key=f"tt-async-{size}-{gpus}gpu-{prec}-{'async' if overlap else 'vanilla'}",
                    source=(f"{TT_ASYNC}, table Llama3 {size} on {gpus} H100s, row "
                            f"{'None (bfloat16)' if prec == 'bf16' else 'float8 tensorwise'}, "
                            f"column {'Async' if overlap else 'Vanilla'} TP tokens/sec"),
                    arch=arch, seq=8192, gpu=H100_96, gpus=gpus, tp=8, pp=1, dp=dp,
                    global_batch=lbs * dp, microbatch=lbs, shard="parameters", recompute=ac,
                    precision=prec, compiled=True, tp_overlap=overlap,
                    published_tokens_per_gpu_s=tps,
                ))  # fmt: skip
    # torchtitan on 64 A100 80GB (April 2024): FSDP 64, Llama 2 and Llama 3.
    for name, arch, seq, lbs, ac, wps in TT_A100_ROWS:
        out.append(Run(
            key=f"tt-a100-{name}-bs{lbs}-{ac.replace('selective', 'selective-op')}",
            source=f"{TT_A100}, {name[:2].upper()} table, row {name[3:].upper()} batch {lbs} "
                   f"{'selective op' if ac == 'selective' else ac} AC",
            arch=arch, seq=seq, gpu="A100-80GB", gpus=64, tp=1, pp=1, dp=64,
            global_batch=64 * lbs, microbatch=lbs, shard="parameters", recompute=ac,
            fused_norm=True, published_tokens_per_gpu_s=wps,
        ))  # fmt: skip
    # Megatron-Core weak scaling (2024), H100 SXM 80GB (NVIDIA Eos, DGX H100).
    for size, heads, hidden, layers, tp, pp, dp, gpus, batch, tflops in MCORE_ARCHS:
        # untied embedding and output (the sizes in the table count both)
        a = _gpt(f"gpt-{size}", layers, hidden, heads, 131072, dropout=False, tied=False)
        out.append(Run(
            key=f"mcore-{size.lower()}", source=f"{MCORE}, row {size}", arch=a, seq=4096,
            gpu="H100-SXM-80GB", gpus=gpus, tp=tp, pp=pp, dp=dp, global_batch=batch,
            shard="optimizer", recompute="selective", grad_overlap=True, tp_overlap=tp > 1,
            published_tokens_per_gpu_s=_tokens(tflops, megatron_core_flops_per_token(a, 4096)),
            note=f"{tflops} TFLOP/s per GPU / Megatron's FLOPs per token",
        ))  # fmt: skip
    # Narayanan et al. SC21, Table 1, A100-80GB.
    for size, heads, hidden, layers, tp, pp, gpus, batch, tflops, mbs, per_v, ddp in SC21_ARCHS:
        a = _gpt(f"gpt-{size}", layers, hidden, heads, 51200, dropout=True)
        out.append(Run(
            key=f"sc21-{size.lower()}", source=f"{SC21}, row {size}; {SC21_SCRIPT}", arch=a,
            seq=2048, gpu="A100-80GB", gpus=gpus, tp=tp, pp=pp, dp=gpus // (tp * pp),
            global_batch=batch, microbatch=mbs, grad_overlap=ddp,
            schedule="interleaved-1f1b" if per_v else "1f1b",
            virtual_stages=layers // (pp * per_v) if per_v else 1,
            recompute="full", sequence_parallel=False, flash=False,
            published_tokens_per_gpu_s=_tokens(tflops, megatron_sc21_flops_per_token(a, 2048)),
            note=f"{tflops} TFLOP/s per GPU / the paper's FLOPs per token",
        ))  # fmt: skip
    # Llama 3 paper (arXiv 2407.21783), Table 4: 405B on H100 (BF16 MFU 43% / 41% / 38%).
    for gpus, cp, dp, seq, tflops in ((8192, 1, 64, 8192, 430), (16384, 1, 128, 8192, 400),
                                      (16384, 16, 8, 131072, 380)):  # fmt: skip
        a = LLAMA31_405B
        out.append(Run(
            key=f"llama3-405b-{gpus}gpu-cp{cp}",
            source=f"Llama 3 paper, arXiv 2407.21783, Table 4, row {gpus} GPUs TP 8 CP {cp} PP 16 DP {dp}",
            arch=a, seq=seq, gpu="H100-SXM-80GB", gpus=gpus, tp=8, pp=16, dp=dp, cp=cp,
            global_batch=16 * 2**20 // seq, microbatch=1, shard="parameters",
            fsdp_under_pp=True, schedule="interleaved-1f1b", virtual_stages=2,
            recompute="none", grad_overlap=True,
            published_tokens_per_gpu_s=_tokens(tflops, megatron_core_flops_per_token(a, seq)),
            note=f"{tflops} TFLOP/s per GPU / Megatron's FLOPs per token (Meta's count unstated)",
        ))  # fmt: skip
    # BLOOM-176B: BigScience's model page (bigscience.notion.site, "BigScience 176B Model"):
    # 384 A100 80GB, one replica on 48 GPUs (TP 4 x PP 12) using 60 GB each, ~150 TFLOP/s;
    # arXiv 2211.05100 section 3.4: ZeRO-1, bf16, 4 x 100 Gb/s Omni-Path per 8-GPU node.
    # Dropout on: bigscience train/tr11-176B-ml/README.md, "The default Megatron-LM dropout
    # settings are inherited: --attention-dropout 0.1 --hidden-dropout 0.1" (its slurm script
    # sets neither).
    bloom = _gpt("bloom-176b", 70, 14336, 112, 250880, dropout=True)
    out.append(Run(
        key="bloom-176b", source="BigScience 176B model page (bigscience.notion.site) + arXiv 2211.05100 sec. 3.4",
        arch=bloom, seq=2048, gpu="A100-80GB", gpus=384, tp=4, pp=12, dp=8, global_batch=2048,
        microbatch=2, shard="optimizer", recompute="full", sequence_parallel=False, flash=False,
        fp32_grad_buffer=True,
        published_tokens_per_gpu_s=_tokens(150, megatron_sc21_flops_per_token(bloom, 2048)),
        published_memory_gib=60e9 / GIB, inter_node_bandwidth_bytes_per_s=4 * 100e9 / 8 / 8,
        note="~150 TFLOP/s per GPU / Megatron-DeepSpeed's FLOPs per token (with recompute)",
    ))  # fmt: skip
    return out


def _reduce_dtypes(runs: list[Run]) -> list[Run]:
    """Each run's gradient reduction dtype as its trainer sets it (:attr:`Run.grad_reduce_fp32`):
    fp32 for torchtitan, Megatron-Core (bf16), the Llama 3 paper's runs and BLOOM's DeepSpeed
    ``BF16_Optimizer``."""
    fp32 = ("tt-", "mcore-", "llama3-", "bloom-")
    return [dataclasses.replace(r, grad_reduce_fp32=r.key.startswith(fp32)) for r in runs]


RUNS: list[Run] = _reduce_dtypes(_runs())


# ----- what autopipe can express -----


def _request_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(PlanRequest)}


def missing_features(run: Run) -> list[str]:
    """What the run uses that autopipe's planner cannot express (empty: it can be priced)."""
    fields = _request_fields()
    missing = []
    if run.cp > 1 and "context_parallel" not in fields:
        missing.append("context parallelism")
    if not is_catalog_device(run.gpu):
        missing.append(f"GPU {run.gpu} in the catalog")
    if run.precision == "fp8" and "precision" not in fields:
        missing.append("FP8 matmuls")
    if run.recompute == "selective" and "selective_recompute" not in fields:
        missing.append("selective activation checkpointing")
    if run.tp > 1 and not run.sequence_parallel and "sequence_parallel" not in fields:
        missing.append("TP without sequence parallelism")
    if run.tp > 1 and run.tp_overlap and "tp_comm_overlap" not in fields:
        missing.append("TP comm overlap")
    if run.dp > 1 and run.grad_overlap and run.shard in ("none", "optimizer"):
        if "grad_reduce_overlap" not in fields:
            missing.append("gradient reduce-scatter overlapped with backward")
    if run.fsdp_under_pp and run.pp > 1 and "reshard_after_forward" not in fields:
        missing.append("FSDP2 under PP (reshard_after_forward=False)")
    return missing


# ----- the closed-form profile -----


@dataclass(frozen=True)
class Pricing:
    """How a unit's counts become seconds on one GPU."""

    matmul_flops_per_s: float
    """Sustained matmul FLOP/s (peak x efficiency) in the run's precision."""
    memory_bytes_per_s: float
    """Sustained bandwidth of memory-bound kernels (peak x efficiency)."""


def pricing_for(spec: DeviceSpec) -> Pricing:
    """bf16 matmuls at the catalog's peak x its compute efficiency, element-wise passes at its
    memory bandwidth x memory efficiency (what the analytic profiler uses)."""
    return Pricing(
        spec.peak_for("bfloat16") * spec.compute_efficiency,
        spec.memory_bandwidth_bytes_per_s * spec.memory_efficiency,
    )


LOSS_BYTES_PER_LOGIT = {
    "torch": (14.0, 22.0),
    "torch-loss-parallel": (38.0, 38.0),
    "megatron": (38.0, 14.0),
}
"""Bytes per logit each loss's memory-bound ops move, forward and backward (bf16 logits in, their
bf16 gradient out), counted op by op by ``benchmarks/loss_bytes.py`` (torch 2.13,
Megatron-Core 0.16.1; ``tests/test_loss_bytes.py`` checks them against a fresh count):
``torch``, ``F.cross_entropy(logits.float())``: the fp32 copy 6, ``log_softmax`` 8; backward
the NLL gradient's zero fill 4, ``log_softmax``'s backward 12, the cast back 6. Under
``loss_parallel()`` torch's handlers run max 4, two shifts 16, exp 8 and sum 4 beside the copy
6; backward a zero fill 4, exp 8, add 12, mul 8, cast 6. Megatron's vocab-parallel loss: copy
6, max 4, in-place shift 8, exp 8, sum 4, division 8; backward the in-place product 8 and the
cast 6 (its target scatter and the per-token terms are not per logit). Before this table the
head priced 10 forward and 20 backward for every trainer."""

_LOSS_PEAK_BYTES = {"torch": 4 + 4 + 4, "torch-loss-parallel": 4 + 4 + 4 + 4, "megatron": 4 + BF16}
"""Bytes per logit live at the loss's peak, its backward (the fp32 log-softmax output saved in
forward included). ``torch``: ``cross_entropy(logits.float(), labels)`` (torchtitan's loss;
the bf16 logits are freed, ``del pred``, before the backward): the saved fp32 log-softmax (4),
the incoming fp32 gradient of it (4) and the fp32 input gradient (4); its forward peaks lower,
at 10 (bf16 logits, fp32 copy, log-softmax). ``torch-loss-parallel``: the same loss on
logits sharded over TP under ``torch.distributed.tensor.parallel.loss_parallel()``
(torchtitan with TP), whose DTensor handlers compute it op by op in eager
(``torch/distributed/tensor/parallel/loss.py``): ``_nll_loss_and_log_softmax_backward`` makes
``grad_input = torch.zeros_like(x)`` and returns ``(grad_input + torch.exp(x)) * grad_output``
while the saved log-softmax ``x`` is alive, so the saved log-softmax, the zeros, ``exp(x)`` and
their sum (then the product in the place of ``exp(x)``) are four fp32 copies at once (16); its
forward (``_log_softmax``: the fp32 copy, ``x - x_max``, ``exp`` of that, beside the bf16
logits) peaks at 14. ``megatron``: ``vocab_parallel_cross_entropy``
computes the softmax in the fp32 copy of the logits and the gradient in place in it (4) and
casts that to bf16 (2); its forward peaks at the bf16 logits and the copy (6) too."""


TORCHTITAN_HEAD_NORM_BYTES = 4 + BF16
"""Bytes per element of ``[tokens, h]`` that torchtitan's final norm saves for backward:
``RMSNorm.forward`` (torchtitan/models/norms.py at 9dec370, ``norm_type = "rmsnorm"`` in its
Llama 3 configs) computes ``self._norm(x.float()).type_as(x) * self.weight`` in eager (only the
transformer blocks are compiled, ``apply_compile``), so autograd keeps the fp32 ``x.float()``
(read by ``pow`` and by ``x * rsqrt(...)``, 4) and the bf16 normalized output (read by ``*
weight``, 2); the per-token ``rsqrt`` is negligible. Under TP the norm is ``SequenceParallel``:
both are ``1/T`` of the tokens on each rank."""


def _linear_s(
    spec: DeviceSpec,
    tokens_mm: int,
    fan_in: int,
    fan_out: int,
    split_out: bool,
    tp: int,
    tokens: int,
) -> tuple[float, float]:
    """Forward and backward seconds of one ``fan_in -> fan_out`` linear over ``tokens`` tokens,
    the whole layer's (``tp`` ranks' worth: the mesh divides it by ``tp`` again), each GEMM
    priced at the shape one TP rank runs on a micro-batch of ``tokens_mm`` tokens: forward
    ``(t x k) @ (k x n)``, backward the input gradient ``(t x n) @ (n x k)`` and the weight
    gradient ``(k x t) @ (t x n)``; ``split_out``: the output features are split (column
    parallel), else the input features (row parallel)."""
    k, n = (fan_in, fan_out / tp) if split_out else (fan_in / tp, fan_out)
    scale = tp * tokens / tokens_mm
    fwd = gemm_s(spec, tokens_mm, n, k)
    bwd = gemm_s(spec, tokens_mm, k, n) + gemm_s(spec, k, n, tokens_mm)
    return fwd * scale, bwd * scale


def _block_linears_s(
    a: Arch, spec: DeviceSpec, tokens_mm: int, tp: int, tokens: int
) -> tuple[float, float]:
    """Forward and backward seconds of a block's weight matmuls (:func:`_linear_s` each): QKV
    and the MLP's up (and gate) column parallel, the attention output and the MLP's down row
    parallel (Megatron's and torchtitan's TP plans)."""
    h, f = a.hidden, a.ffn
    shapes = [(h, h + 2 * a.kv_dim, True), (h, h, False), (f, h, False)]
    shapes += [(h, f, True)] * (2 if a.gated else 1)
    parts = [_linear_s(spec, tokens_mm, i, o, col, tp, tokens) for i, o, col in shapes]
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def _attention_s(
    a: Arch, seq: int, spec: DeviceSpec, flash: bool, tokens_mm: int, kernel: str = DEFAULT_KERNEL
) -> tuple[float, float]:
    """Forward and backward seconds of a block's attention matmuls (QK^T and AV) on
    ``tokens_mm`` tokens: flash attention's fused ``kernel`` (causal: half the scores; backward
    2.5 times the forward's FLOPs, the scores re-computed) at that kernel's published share of
    the GPU's peak in each direction (``autopipe.core.attention``; its ``s x s`` scores never
    reach memory); the math path as two batched GEMMs per head (``s x d`` by ``d x s``, writing
    the scores; ``s x s`` by ``s x d``) at their shape, backward twice the forward."""
    flops = tokens_mm * 4 * seq * a.hidden * (0.5 if flash else 1.0)
    if flash:
        peak = spec.peak_for("bfloat16")
        fwd = flops / (peak * attention_efficiency(spec, kernel, "forward"))
        return fwd, 2.5 * flops / (peak * attention_efficiency(spec, kernel, "backward"))
    d, heads = a.hidden // a.heads, a.heads * tokens_mm / seq
    fwd = gemm_s(spec, seq, seq, d, batch=heads) + gemm_s(spec, seq, d, seq, batch=heads)
    return fwd, 2.0 * fwd


def _elementwise_elements(a: Arch, compiled: bool) -> float:
    """Element reads + writes per token of one block's memory-bound ops in forward.

    Unfused (eager): each norm reads its input and writes its output in ~3 passes, each
    residual add reads two and writes one, rotary reads and writes q and k twice (Llama), the
    activation reads the MLP's up (and gate) output and writes its product, dropout (GPT of
    2021) reads and writes and stores a mask. Fused (torch.compile / Megatron's fused
    kernels): one read and one write per op's distinct tensors."""
    h, f, kv = a.hidden, a.ffn, a.kv_dim
    norms = 2 * (2 * h) * (1 if compiled else 3)
    residual = 2 * 3 * h
    rope = (2 * (h + kv) * (1 if compiled else 2)) if a.gated else 0.0
    act = (3 * f if a.gated else 2 * f) * (1 if compiled else 2)
    drop = (3 * 3 * h) if a.dropout and not compiled else 0.0
    return norms + residual + rope + act + drop


TORCHTITAN_EAGER = (
    "torchtitan 9dec370 (the benchmark's commit): torchtitan/models/norms.py RMSNorm, "
    "torchtitan/models/llama/model.py apply_rotary_emb, repeat_kv, Attention.forward, "
    "FeedForward.forward"
)


TORCHTITAN_EAGER_BYTES_PER_TOKEN: dict[str, dict[str, float]] = {
    "forward": {"h": 108, "kv": 24, "ffn": 10, "head_dim": 8, "1": 48},
    "backward": {"h": 238, "kv": 24, "ffn": 18, "head_dim": 24, "1": 80},
    "selective_forward": {"h": 108, "kv": 24, "ffn": 10, "head_dim": 8, "1": 48},
    "selective_backward": {"h": 340, "kv": 48, "ffn": 28, "head_dim": 32, "1": 128},
    "full_forward": {"h": 108, "kv": 24, "ffn": 10, "head_dim": 8, "1": 48},
    "full_backward": {"h": 340, "kv": 48, "ffn": 28, "head_dim": 32, "1": 128},
}
"""Bytes per token one torchtitan Llama block's memory-bound ops move run eagerly (its runs
without ``torch.compile``; :data:`TORCHTITAN_EAGER`), as measured, not counted by hand:
``benchmarks/eager_block_bytes.py`` runs the block ``benchmarks/compiled_block_bytes.py``
writes from torchtitan 9dec370's model code, eagerly in bf16, forward and backward, under a
``TorchDispatchMode`` that sums each dispatched op's tensor inputs read and outputs written
(one kernel per op; matmuls and SDPA left out, as are views: ops whose outputs all share an
input's storage); coefficients of ``h``, ``kv`` (``kv_heads x head_dim``), ``ffn``,
``head_dim`` and 1, exact (no residual) over seven shapes and checked against a fresh
measurement by ``tests/test_eager_block_bytes.py``. Graphs as
:data:`TORCHTITAN_COMPILED_BYTES_PER_TOKEN`'s: ``forward`` and ``backward`` without
activation checkpointing, ``selective_*`` under torchtitan's ``op`` policy (the backward
re-computes every element-wise op, the last residual add excepted: the checkpoint stops
re-computing once the saved tensors are back), ``full_*`` under full AC (the same
element-wise ops re-computed).

What the ops show (forward): each RMSNorm ``(x.float() * rsqrt(x.float().pow(2).mean(-1) +
eps)).type_as(x) * weight`` moves 36 bytes per element (the fp32 copy 2 + 4, ``pow`` 4 + 4,
``mean``'s read 4, the product 4 + 4, the cast back 4 + 2, the weight 2 + 2) and 24 per token
(the fp32 ``mean``, ``+ eps``, ``rsqrt`` and the product's read of it); the residual adds 6
per element; rotary 20 per element of q and k (``float`` 2 + 4, the complex product 4 + 4,
``type_as`` 4 + 2) and ``freqs_cis`` read by each product (4 per ``head_dim`` each);
``repeat_kv``'s copy reads k and v and writes them at every query head; SwiGLU 10 per
``ffn``. The attention output's ``transpose(1, 2).contiguous()``, counted as a copy before
(4 h), is none: SDPA returns its output in the query's ``[b, s, heads, d]`` layout (flash
attention's CUDA kernel as its CPU one). Backward: 238 h + 24 kv + 18 ffn + 24 head_dim + 80
(assumed twice the forward before); a selective re-computation 102 h + 24 kv + 10 ffn + 8
head_dim + 48 (assumed one forward)."""


TORCHTITAN_FUSED_NORM_EAGER_BYTES_PER_TOKEN: dict[str, dict[str, float]] = {
    "forward": {"h": 44, "kv": 24, "ffn": 10, "head_dim": 8, "1": 8},
    "backward": {"h": 66, "kv": 24, "ffn": 18, "head_dim": 24, "1": 8},
    "selective_forward": {"h": 44, "kv": 24, "ffn": 10, "head_dim": 8, "1": 8},
    "selective_backward": {"h": 104, "kv": 48, "ffn": 28, "head_dim": 32, "1": 16},
    "full_forward": {"h": 44, "kv": 24, "ffn": 10, "head_dim": 8, "1": 8},
    "full_backward": {"h": 104, "kv": 48, "ffn": 28, "head_dim": 32, "1": 16},
}
""":data:`TORCHTITAN_EAGER_BYTES_PER_TOKEN` with the block's two RMSNorms as torchtitan's
``fused_rmsnorm`` Triton kernels (``norm_type = "fused_rmsnorm"`` in its April 2024 configs,
157a12c56, which its 64-A100 runs used), measured the same way:
``benchmarks/eager_block_bytes.py --norm fused --ac all`` (each kernel once: forward 4 bytes per
element and 4 per token for its fp32 ``rstd``, backward 6 and 4), exact over the seven shapes.
Against the eager norms: forward ``64 h + 40`` and backward ``172 h + 72`` bytes per token
fewer (at Llama 3 8B, 262,184 and 704,584)."""


def torchtitan_eager_bytes(a: Arch, graph: str = "forward", norm: str = "eager") -> float:
    """Bytes per token of ``graph`` (:data:`TORCHTITAN_EAGER_BYTES_PER_TOKEN`, or with
    ``norm="fused"`` :data:`TORCHTITAN_FUSED_NORM_EAGER_BYTES_PER_TOKEN`) for ``a``, as
    torchtitan's eager model code (:data:`TORCHTITAN_EAGER`) moves them; ``torch.compile``
    fuses some of these (:func:`torchtitan_compiled_bytes`, measured likewise)."""
    if norm == "fused":
        return _per_token(a, TORCHTITAN_FUSED_NORM_EAGER_BYTES_PER_TOKEN[graph])
    return _per_token(a, TORCHTITAN_EAGER_BYTES_PER_TOKEN[graph])


def _per_token(a: Arch, coefficients: dict[str, float]) -> float:
    """A measured table's bytes per token for ``a``: its ``coefficients`` of ``h``, ``kv``,
    ``ffn``, ``heads``, ``head_dim`` (``"1"``: a constant)."""
    head_dim = a.hidden // a.heads
    value = {"h": a.hidden, "kv": a.kv_dim, "ffn": a.ffn, "heads": a.heads, "head_dim": head_dim}
    return sum(c * value.get(t, 1) for t, c in coefficients.items())


TORCHTITAN_COMPILED_BYTES_PER_TOKEN: dict[str, dict[str, float]] = {
    "forward": {"h": 42, "kv": 20, "ffn": 6, "heads": 0, "head_dim": 8, "1": 8},
    "backward": {"h": 62, "kv": 20, "ffn": 10, "heads": 8, "head_dim": 16, "1": 16},
    "selective_forward": {"h": 42, "kv": 20, "ffn": 6, "head_dim": 8},
    "selective_backward": {"h": 94, "kv": 40, "ffn": 12, "heads": 8, "head_dim": 24, "1": 24},
    "full_forward": {"h": 42, "kv": 20, "ffn": 6, "head_dim": 8},
    "full_backward": {"h": 96, "kv": 40, "ffn": 12, "heads": 8, "head_dim": 24, "1": 24},
    # the same block with torchtitan's Float8 (torchao 0.18.0 Float8Linear, tensorwise dynamic)
    "float8_forward": {"h": 59, "kv": 20, "ffn": 9, "head_dim": 8, "1": 24},
    "float8_backward": {"h": 101.5, "kv": 27, "ffn": 34, "heads": 8, "head_dim": 16, "1": 24},
    "float8_selective_forward": {"h": 59, "kv": 20, "ffn": 9, "head_dim": 8, "1": 24},
    "float8_selective_backward": {
        "h": 136.5,
        "kv": 47,
        "ffn": 34,
        "heads": 8,
        "head_dim": 24,
        "1": 32,
    },
    "float8_full_forward": {"h": 59, "kv": 20, "ffn": 9, "head_dim": 8, "1": 24},
    "float8_full_backward": {"h": 152.5, "kv": 47, "ffn": 34, "heads": 8, "head_dim": 24, "1": 52},
}
"""Bytes per token one torchtitan Llama block's memory-bound kernels move compiled (its
``apply_compile``: ``torch.compile(block, fullgraph=True)``), as measured, not assumed:
``benchmarks/compiled_block_bytes.py`` compiles the block (written from torchtitan 9dec370's
model code) with inductor and reads each generated kernel's buffer traffic (inductor's own
``count_bytes``), matmuls and SDPA left out; coefficients of ``h``, ``kv`` (``kv_heads x
head_dim``), ``ffn``, ``heads``, ``head_dim`` and 1, exact (no residual) over seven shapes
and checked against a fresh measurement by ``tests/test_compiled_block_bytes.py``. Graphs:
``forward`` and ``backward`` without activation checkpointing; ``selective_*`` under
torchtitan's ``op`` policy (the backward graph re-computes what it drops, fused into it).
What the kernels show (forward): the rotary embedding is not fused at all (inductor has no
lowering for complex multiplication, device-independent: ``x.float()``, the complex product
as an eager fallback and ``type_as`` stay three passes, 20 bytes per element of q and k, as
in eager), ``repeat_kv`` is a copy of k (fused with k's cast back) and of v to every head;
each norm is one kernel, the residual sum is re-computed by its consumers rather than
stored, SwiGLU is one kernel (6 bytes per ``ffn``). Backward: the norms' weight gradients
are a second kernel that re-reads the norms' inputs and gradients (a reduction over the
tokens, not over ``h``), the gradients of q/k/v's inputs and of w1/w3's are read as separate
matmul outputs, the rotary backward is again three passes, the repeated k/v gradients summed
back.

``float8_*``: the block's seven linears converted as torchtitan's Float8 converter does
(torchao's ``convert_to_float8_training``, tensorwise dynamic scaling; ``_scaled_mm`` left out
with the other matmuls). Beyond the bf16 block (:func:`torchtitan_fp8_cast_bytes`): forward
``17 h + 3 ffn + 16`` (each matmul input's ``max(abs)`` and FP8 copy: the attention norm's
output once for q, k and v, the attention output, the MLP norm's output, the SwiGLU
product), backward ``39.5 h + 7 kv + 24 ffn + 8`` (each output gradient's amax and FP8 copies
in the two layouts ``_scaled_mm`` takes, the inputs cast again for the weight gradients).
torchao 0.7.0, the release before 9dec370 (it saves the FP8 input and weight instead of
casting again in backward), measures the same forward and ``6 h + 8`` less backward."""


def torchtitan_compiled_bytes(a: Arch, graph: str) -> float:
    """Bytes per token of ``graph`` (:data:`TORCHTITAN_COMPILED_BYTES_PER_TOKEN`) for ``a``."""
    return _per_token(a, TORCHTITAN_COMPILED_BYTES_PER_TOKEN[graph])


TORCHTITAN_COMPILED_FULL_AC_SAVED_BYTES_PER_TOKEN: dict[str, float] = {"h": 8, "ffn": 4, "1": 8}
"""Bytes per token the bf16 compiled torchtitan block's memory-bound kernels move fewer under
full activation checkpointing than a forward re-run would add: a forward, the forward again
and the backward without AC (``2 forward + backward`` of
:data:`TORCHTITAN_COMPILED_BYTES_PER_TOKEN`) less the forward and the backward graph, with
its re-computation fused in, under full AC (``full_forward + full_backward``). Measured:

    .venv/bin/python benchmarks/compiled_block_bytes.py --ac none
    .venv/bin/python benchmarks/compiled_block_bytes.py --ac full

(torch 2.13 CPU inductor, exact over the seven fitted shapes: ``--ac none`` forward ``42 h +
20 kv + 6 ffn + 8 head_dim + 8``, backward ``62 h + 20 kv + 10 ffn + 8 heads + 16 head_dim +
16``; ``--ac full`` forward ``42 h + 20 kv + 6 ffn + 8 head_dim``, backward ``96 h + 40 kv +
12 ffn + 8 heads + 24 head_dim + 24``): ``146 h + 60 kv + 22 ffn + 8 heads + 32 head_dim + 32``
against ``138 h + 60 kv + 18 ffn + 8 heads + 32 head_dim + 24``, ``8 h + 4 ffn + 8`` fewer
(Llama 3.1 8B: 90,120 of a forward's 279,560 per token, 32%). The re-computation is inductor's
fused into the backward graph: what the forward kernels write only for the backward to read
(the SwiGLU product's inputs and output, the norms' outputs) is re-computed where the
backward reads it. The published runs' compiled torchtitan blocks carry it as a negative
``full_recompute_extra_s`` (:func:`torchtitan_full_recompute_extra_bytes`); their eager
blocks re-run a forward (``benchmarks/eager_block_bytes.py``: the same ops again, the last
residual add excepted)."""


def torchtitan_full_recompute_extra_bytes(a: Arch) -> float:
    """Bytes per token a compiled torchtitan block's full-AC re-run moves beyond a forward's
    (negative: :data:`TORCHTITAN_COMPILED_FULL_AC_SAVED_BYTES_PER_TOKEN` fewer)."""
    return -_per_token(a, TORCHTITAN_COMPILED_FULL_AC_SAVED_BYTES_PER_TOKEN)


TORCHTITAN_FLOAT8_WEIGHT_BYTES = {"forward": 5, "backward": 3}
"""Bytes per weight element a compiled float8 block (``float8_*`` above) moves for its
weights in each graph call beyond the bf16 block, measured likewise (what does not scale with
the tokens, fitted as coefficients of the weight elements, no AC): forward the weight's
``max(abs)`` (read 2) and its FP8 copy (read 2, write 1), backward the FP8 copy again for
the input gradient. Not priced: no published run casts its weights there. torchtitan's
Float8 recipe (docs/float8.md at 9dec370: ``--float8.enable_fsdp_float8_all_gather
--float8.precompute_float8_dynamic_scale_for_fsdp``) casts each weight on its FSDP shard
before the all-gather, outside the compiled block (the gathered weight arrives already FP8
and the block casts nothing), once per all-gather, eagerly:
:data:`TORCHTITAN_FSDP_FLOAT8_WEIGHT_BYTES`, priced."""


TORCHTITAN_FSDP_FLOAT8_WEIGHT_BYTES = {"all_gather": 21, "step": 4}
"""Bytes per weight element of torchtitan's Float8 FSDP recipe on each rank's fp32 shard,
measured (``benchmarks/eager_block_bytes.py --fsdp-float8``: torchao 0.18.0's
``fsdp_pre_all_gather`` as FSDP2 calls it, eagerly, on its copy-in stream): per all-gather the
scale's ``mul`` (8), ``clamp`` (8) and the FP8 copy (5); per step the amax
(``_foreach_norm(inf)``, 4). The profile's ``fp8_gather_cast_bytes`` / ``fp8_weight_amax_bytes``
of each block (its seven linears' weights), priced under FP8 with ``parameters`` sharding."""


def torchtitan_fp8_cast_bytes(a: Arch, graph: str) -> float:
    """Bytes per token torchtitan's Float8 adds to ``graph`` of a compiled block: the float8
    block's bytes less the bf16 block's, both measured
    (:data:`TORCHTITAN_COMPILED_BYTES_PER_TOKEN`). ``graph``: ``forward`` or ``backward``
    without activation checkpointing (``selective_forward``... under a mode), or ``selective``
    / ``full``: that mode's forward and backward together (17 h + 3 ffn + 24 forward under
    either; backward with the re-computation 42.5 h + 7 kv + 22 ffn + 8 selective, 56.5 h +
    7 kv + 22 ffn + 28 full)."""
    if graph in ("selective", "full"):
        return sum(torchtitan_fp8_cast_bytes(a, f"{graph}_{g}") for g in ("forward", "backward"))
    return torchtitan_compiled_bytes(a, f"float8_{graph}") - torchtitan_compiled_bytes(a, graph)


MEGATRON_FUSED = (
    "megatron-core 0.16.1 (installed): get_gpt_layer_local_spec's TransformerLayer; "
    "megatron/core/fusions/fused_bias_gelu.py, fused_bias_dropout.py, fused_softmax.py; "
    "Megatron-LM megatron/fused_kernels/scaled_upper_triang_masked_softmax.h"
)


MEGATRON_FUSED_BYTES_PER_TOKEN: dict[str, dict[str, float]] = {
    "sc21_forward": {"h": 38, "ffn": 4, "heads_seq": 8, "heads": 4, "1": 16},
    "sc21_backward": {"h": 60, "ffn": 8, "heads_seq": 9, "heads": 8, "1": 16},
    "sc21_replicated": {"h": 22, "1": 16},
    "mcore_forward": {"h": 32, "ffn": 4, "1": 16},
    "mcore_backward": {"h": 46, "ffn": 8, "1": 16},
    "mcore_replicated": {"h": 20, "1": 16},
}
"""Bytes per token Megatron's GPT layer (:data:`MEGATRON_FUSED`) moves in its memory-bound
ops as Megatron fuses them, measured, not counted by hand: ``benchmarks/megatron_block_bytes.py``
runs the installed megatron-core's own layer on the CPU, bf16, forward and backward, under a
``TorchDispatchMode`` that sums each op's tensor inputs read and outputs written (matmuls,
``baddbmm`` and SDPA left out), each of Megatron's fused kernels counted as one kernel: bias-GeLU
and its backward (``fused_bias_gelu.py``), bias-dropout-add (``fused_bias_dropout.py``), the
causal softmax as its CUDA kernel reads (each row up to the diagonal) and writes
(``ScaledUpperTriangMaskedSoftmax``), the LayerNorm as one ``native_layer_norm`` (apex's and
Transformer Engine's one kernel, fp32 statistics); the rest op by op (the QKV bias add and its
gradient's sum, the attention dropout as CUDA's ``native_dropout``, the context's permute copy,
the ``baddbmm`` backward's scale, the q/k/v gradients' ``cat``, autograd's residual gradient
sums). Coefficients of ``h``, ``ffn``, ``heads_seq`` (``heads x seq``: the scores the softmax
and the attention dropout touch per token), ``heads`` and 1; exact (no residual) over five shapes
at three sequence lengths each, checked against a fresh measurement by
``tests/test_megatron_block_bytes.py``.

``sc21_*``: the layer of SC21's Megatron-LM and BLOOM's Megatron-DeepSpeed (hidden and
attention dropout 0.1, the unfused core attention with the fused causal softmax); ``mcore_*``:
Megatron-Core's 2024 runs as configured here (no dropout, flash attention: the core attention
one fused kernel, left out). ``*_replicated``: the forward's LayerNorms and bias-dropout-adds,
what TP without sequence parallelism runs whole on every rank. Forward (sc21): each LayerNorm
4 h + 8, the QKV bias add 12 h, the context copy 4 h, each bias-dropout-add 7 h (x, residual,
output, the 1-byte mask), bias-GeLU 4 ffn; the softmax 3 heads x seq + 4 heads (reads half the
scores, writes all the probabilities), the attention dropout 5 heads x seq. Backward: 60 h + 8
ffn + 9 heads x seq + 8 heads + 16 against the generic count's twice the forward. Without
dropout (mcore) the masks, the context copy and the ``baddbmm`` scales are gone (a flash
kernel's output is in ``[s, b, h]`` already). Transformer Engine's linears (the mcore runs)
add the QKV bias in the GEMM epilogue: the 12 h forward and the bias gradient's 6 h backward
are counted here, as the local spec runs them."""


def megatron_fused_bytes(a: Arch, seq: int, graph: str) -> float:
    """Bytes per token of ``graph`` (:data:`MEGATRON_FUSED_BYTES_PER_TOKEN`) for ``a`` at
    sequence ``seq``."""
    coefficients = dict(MEGATRON_FUSED_BYTES_PER_TOKEN[graph])
    heads_seq = coefficients.pop("heads_seq", 0.0) * a.heads * seq
    return heads_seq + _per_token(a, coefficients)


def megatron_layer(a: Arch, flash: bool) -> str:
    """Which measured Megatron layer (:data:`MEGATRON_FUSED_BYTES_PER_TOKEN`) prices ``a``:
    ``sc21`` (dropout, the unfused core attention) or ``mcore`` (neither); a ValueError for an
    architecture not measured (gated, or dropout with flash attention)."""
    if not a.gated and a.dropout and not flash:
        return "sc21"
    if not a.gated and not a.dropout and flash:
        return "mcore"
    raise ValueError(
        f"Megatron's fused layer is measured for GPT with dropout and no flash attention or "
        f"neither, not {a.name} (gated {a.gated}, dropout {a.dropout}, flash {flash})"
    )


def _block_activation_bytes(a: Arch, seq: int, flash: bool) -> float:
    """Bytes a block saves for backward per token (bf16), Korthikanti et al. (arXiv 2205.05198)
    counted for the architecture: attention norm input, QKV input, q/k/v, attention output
    (flash: with its log-sum-exp; math path: the scores, softmax and its dropout mask too),
    the MLP's norm input, its input, its up/gate outputs and activation, dropout masks."""
    h, f, kv = a.hidden, a.ffn, a.kv_dim
    attn = BF16 * (h + h + (h + 2 * kv) + h)
    if not flash:
        # scores, softmax output (2 bytes each) and its dropout mask (1 byte), per head per key
        attn += (2 + 2 + (1 if a.dropout else 0)) * a.heads * seq
    mlp = BF16 * (h + h + (4 * f if a.gated else 2 * f))
    masks = 2 * h if a.dropout else 0
    return attn + mlp + masks


def transformer_profile(
    a: Arch,
    seq: int,
    spec: DeviceSpec,
    *,
    pricing: Pricing | None = None,
    compiled: bool = False,
    flash: bool = True,
    batch_size: int = 1,
    selective: str = "megatron",
    fp8_head: bool = False,
    gemm_tokens: int | None = None,
    tp: int = 1,
    loss: str = "torch",
    attention_kernel: str = DEFAULT_KERNEL,
    eager: str = "generic",
    repeat_kv: bool = False,
    sequence_dim: int = 0,
    head: str = "generic",
    norm: str = "eager",
) -> Profile:
    """The Profile of ``a`` at ``batch_size`` sequences of ``seq`` tokens on ``spec``: units
    ``embed``, ``layers.0 .. layers.L-1``, ``head`` (final norm, output projection, loss).
    Times at the profile batch; TP fields as the profiler's for a Megatron-style TP plan
    (every block's matmuls split, attention heads split, sequence parallelism on the rest).

    ``selective``: whose selective checkpointing recipe the blocks carry: ``megatron``
    (``--recompute-granularity selective``: the attention core re-computed, its scores, softmax
    and dropout mask dropped; with flash attention it saves nothing more) or ``torchtitan``
    (its ``selective`` op policy: the outputs of attention and of every other matmul kept,
    everything else re-computed: about half the matmuls and every element-wise op, keeping
    ``4h + kv + ffn`` elements per token with the block input). ``fp8_head``: the output projection is an FP8
    linear too (torchtitan leaves ``output`` in bf16).

    Matmuls: with ``pricing`` given, every matmul FLOP at its flat rate; else each GEMM is
    priced at its own shape on ``spec`` (``autopipe.core.gemm``: the GPU's published
    maximum achievable matmul FLOP/s, the share of SMs its output tiles fill, its memory
    bound) as one TP rank runs it: ``gemm_tokens`` tokens per micro-batch (default: the
    profile batch), weights split ``tp`` ways; flash attention's fused kernel at the GPU's
    matmul ceiling.

    ``loss``: how the cross-entropy holds the logits (:data:`_LOSS_PEAK_BYTES`): ``torch``
    (``cross_entropy(logits.float())``, torchtitan) or ``megatron`` (its fused vocab-parallel
    cross-entropy, in place). ``attention_kernel``: the flash-attention kernel family the trainer
    runs (``autopipe.core.attention``: ``fa2``, PyTorch SDPA's flash backend; ``cudnn``,
    Transformer Engine's fused attention), priced at its published share of peak per direction.
    ``eager``: whose element-wise ops a block runs: ``generic`` (:func:`_elementwise_elements`,
    fused or not by ``compiled``) or ``torchtitan`` (its Llama code, op by op:
    :func:`torchtitan_eager_bytes`; ``compiled``, as inductor's kernels measured move them:
    :func:`torchtitan_compiled_bytes`) or ``megatron`` (Megatron's GPT layer with its fused
    kernels, measured: :func:`megatron_fused_bytes`, the layer :func:`megatron_layer` picks;
    ``compiled`` ignored). ``repeat_kv``: the model copies K and V to every query
    head before its SDPA call (torchtitan's Llama, :data:`TORCHTITAN_EAGER`'s ``repeat_kv``),
    so the attention (and context parallelism's exchange of K and V) sees ``heads`` key/value
    heads, not ``kv_heads``. ``sequence_dim``: the activations' dimension sequence
    parallelism shards (``UnitProfile.tp_sequence_dim``): 0, Megatron's ``[s, b, h]``; 1,
    torchtitan's ``[b, s, h]`` with ``Shard(1)``. ``head``: what the head unit saves besides
    the loss's log-softmax: ``generic``, its input (a bf16 ``[tokens, h]``, split over TP by
    sequence parallelism); ``torchtitan`` (:data:`TORCHTITAN_HEAD_NORM_BYTES`), the final
    RMSNorm's eager fp32 tensors too, and the output projection's input as torch's DTensor
    ``ColwiseParallel`` saves it, all-gathered (``tp_gathered_input_bytes``: whole on every TP
    rank). ``norm``: with ``eager="torchtitan"`` uncompiled, ``fused`` prices the RMSNorms as
    torchtitan's ``fused_rmsnorm`` kernels (:data:`TORCHTITAN_FUSED_NORM_EAGER_BYTES_PER_TOKEN`;
    the final norm saves its bf16 input, not the eager norm's fp32 tensors)."""
    price = pricing or pricing_for(spec)
    tokens = batch_size * seq
    h, v = a.hidden, a.vocab
    mm = price.matmul_flops_per_s
    mem = price.memory_bytes_per_s

    # one block, per token
    linear_flops = 2 * (a.block_parameters - 2 * h)
    attn_flops = 4 * seq * h * (0.5 if flash else 1.0)  # QK^T and AV; flash skips the masked half
    attn_bwd = 2.5 if flash else 2.0  # flash re-computes the scores in backward
    attn_counted = 4 * seq * h  # torch's flop registry: unmasked, backward twice the forward
    elem_bytes = BF16 * _elementwise_elements(a, compiled)
    # backward and a selective re-computation: twice and once the forward's unless measured
    bwd_elem_bytes, redo_elem_bytes = 2 * elem_bytes, elem_bytes
    # what a float8 run's casts add (planner/trainer.py prices them under precision="fp8")
    fp8_fwd_bytes = fp8_bwd_bytes = fp8_selective_bytes = fp8_full_bytes = 0.0
    fp8_weights = 0
    # what a full-AC re-run moves beyond a forward (the compiled block's fuses with the backward)
    full_extra_bytes = 0.0
    if eager == "torchtitan" and a.gated:
        # torchtitan's block as measured, eager or compiled (each graph's bytes per token)
        def measured(a: Arch, graph: str) -> float:
            if compiled:
                return torchtitan_compiled_bytes(a, graph)
            return torchtitan_eager_bytes(a, graph, norm)

        if compiled:
            fp8_fwd_bytes = torchtitan_fp8_cast_bytes(a, "forward")
            fp8_bwd_bytes = torchtitan_fp8_cast_bytes(a, "backward")
            # each activation checkpointing mode's casts, forward and backward together, as
            # measured under it (the re-computation's casts fuse with the backward's)
            if selective == "torchtitan":
                fp8_selective_bytes = torchtitan_fp8_cast_bytes(a, "selective")
            fp8_full_bytes = torchtitan_fp8_cast_bytes(a, "full")
            # its float8 FSDP recipe casts the weights on each shard before the all-gather
            fp8_weights = a.block_parameters - 2 * h
            # full AC's re-computation, fused with the backward, moves less than a forward
            full_extra_bytes = torchtitan_full_recompute_extra_bytes(a)
        elem_bytes = measured(a, "forward")
        bwd_elem_bytes = measured(a, "backward")
        redo_elem_bytes = (
            measured(a, "selective_forward")
            + measured(a, "selective_backward")
            - elem_bytes
            - bwd_elem_bytes
        )
    softmax_bytes = 0.0 if flash else (2 + 2 + 2) * a.heads * seq * (1 if compiled else 2)
    norm_elems = 2 * (2 * h) * (1 if compiled else 3) + 2 * 3 * h
    drop_elems = (3 * 3 * h) if a.dropout and not compiled else 0.0
    replicated_bytes = BF16 * (norm_elems + drop_elems)
    if eager == "megatron":
        # Megatron's layer as measured with its fused kernels: the attention core's softmax and
        # dropout (the heads terms) apart, as selective recompute re-runs them
        layer = megatron_layer(a, flash)
        core = {k: v for k, v in MEGATRON_FUSED_BYTES_PER_TOKEN[f"{layer}_forward"].items()
                if k in ("heads_seq", "heads")}  # fmt: skip
        softmax_bytes = (
            core.get("heads_seq", 0.0) * a.heads * seq + core.get("heads", 0.0) * a.heads
        )
        elem_bytes = megatron_fused_bytes(a, seq, f"{layer}_forward") - softmax_bytes
        bwd_elem_bytes = megatron_fused_bytes(a, seq, f"{layer}_backward") - 2 * softmax_bytes
        replicated_bytes = megatron_fused_bytes(a, seq, f"{layer}_replicated")
    fwd_mm = linear_flops / mm
    fwd_attn = attn_flops / mm
    lin_f, lin_b = tokens * fwd_mm, tokens * 2 * fwd_mm
    if pricing is None:  # each GEMM at its shape (autopipe.core.gemm)
        lin_f, lin_b = _block_linears_s(a, spec, gemm_tokens or tokens, tp, tokens)
        attn_f, attn_b = _attention_s(a, seq, spec, flash, gemm_tokens or tokens, attention_kernel)
        fwd_attn, bwd_attn = attn_f / (gemm_tokens or tokens), attn_b / (gemm_tokens or tokens)
    else:
        bwd_attn = attn_bwd * fwd_attn
    fwd_mem = (elem_bytes + softmax_bytes) / mem
    bwd_mem = (bwd_elem_bytes + 2 * softmax_bytes) / mem
    block_fwd = lin_f + tokens * (fwd_attn + fwd_mem)
    block_bwd = lin_b + tokens * (bwd_attn + bwd_mem)
    block_act = tokens * _block_activation_bytes(a, seq, flash)
    # what only sequence parallelism shards: norm inputs, the TP regions' inputs, masks
    replicated_act = tokens * BF16 * (4 * h + (h if a.dropout else 0))
    replicated_share = tokens * replicated_bytes / mem / block_fwd
    if selective == "torchtitan":
        # the block's input (the checkpoint keeps its inputs), the outputs of every other
        # matmul (wq, wv, w1, w2: the policy's odd mm calls), attention's output and its fp32
        # log-sum-exp per head
        kept = tokens * (BF16 * (4 * h + a.kv_dim + a.ffn) + 4 * a.heads)
        # the matmuls it re-runs: the even mm calls, wk, wo and w3 (counted in the compiled
        # backward graph: 17 mm, 14 of the backward and these 3, FP8 ones alike)
        redo_shapes = [(h, a.kv_dim, True), (h, h, False), (h, a.ffn, True)]
        redo_flops = tokens * sum(2 * i * o for i, o, _ in redo_shapes)
        redo_lin = redo_flops / mm
        if pricing is None:
            redo_lin = sum(
                _linear_s(spec, gemm_tokens or tokens, i, o, col, tp, tokens)[0]
                for i, o, col in redo_shapes
            )
        redo = redo_lin + tokens * (redo_elem_bytes + softmax_bytes) / mem
    else:
        scores = 0.0 if flash else tokens * (2 + 2 + (1 if a.dropout else 0)) * a.heads * seq
        kept = block_act - scores
        redo = tokens * (fwd_attn + softmax_bytes / mem)
        redo_flops = 0.0
    hidden_bytes = tokens * h * BF16
    # torchtitan's final norm runs eager (apply_compile compiles the blocks only) in fp32
    norm_bytes = tokens * h * TORCHTITAN_HEAD_NORM_BYTES if head == "torchtitan" else 0
    if head == "torchtitan" and norm == "fused" and not compiled:
        norm_bytes = tokens * h * BF16  # the fused kernel saves its input (and a per-row rstd)
    units = [
        UnitProfile(
            name="embed",
            kind="Embedding",
            forward_s=tokens * 2 * h * BF16 / mem,
            backward_s=tokens * 3 * h * BF16 / mem,
            parameter_count=v * h,
            parameter_bytes=v * h * BF16,
            output_bytes=hidden_bytes,
            tp_parameter_count=v * h,
            tp_compute_fraction=1.0,
            tp_collective_bytes=hidden_bytes // 2,
        )  # fmt: skip
    ]
    for i in range(a.layers):
        units.append(
            UnitProfile(
                name=f"layers.{i}",
                kind="TransformerBlock",
                forward_s=block_fwd,
                backward_s=block_bwd,
                parameter_count=a.block_parameters,
                parameter_bytes=a.block_parameters * BF16,
                activation_bytes=int(block_act),
                output_bytes=hidden_bytes,
                # counted as the analytic profiler counts them (torch's flop registry: the
                # attention unmasked), which is how the planner reads them (context_expert)
                forward_flops=tokens * (linear_flops + attn_counted),
                backward_flops=tokens * (2 * linear_flops + 2 * attn_counted),
                tp_parameter_count=a.block_parameters - 2 * h,
                tp_compute_fraction=1.0,
                tp_collective_bytes=2 * hidden_bytes,
                tp_rowwise_output_bytes=2 * hidden_bytes,  # attention's wo, the MLP's down
                linear_forward_flops=tokens * linear_flops,
                fp8_cast_forward_bytes=int(tokens * fp8_fwd_bytes),
                fp8_cast_backward_bytes=int(tokens * fp8_bwd_bytes),
                fp8_cast_selective_bytes=int(tokens * fp8_selective_bytes),
                fp8_cast_full_bytes=int(tokens * fp8_full_bytes),
                full_recompute_extra_s=tokens * full_extra_bytes / mem,
                fp8_gather_cast_bytes=fp8_weights
                * TORCHTITAN_FSDP_FLOAT8_WEIGHT_BYTES["all_gather"],
                fp8_weight_amax_bytes=fp8_weights * TORCHTITAN_FSDP_FLOAT8_WEIGHT_BYTES["step"],
                selective_activation_bytes=int(kept),
                selective_recompute_s=redo,
                selective_recompute_linear_flops=redo_flops,
                # torchtitan's op policy saves the reduce-scatters, not the all-gathers: both
                # regions' inputs are gathered again for the kept matmuls' weight gradients
                selective_recompute_gather_bytes=2 * hidden_bytes
                if selective == "torchtitan"
                else 0,
                tp_replicated_activation_bytes=int(replicated_act),
                tp_replicated_compute_fraction=replicated_share,
                # what context parallelism exchanges and splits (planner/context_expert.py)
                attention_layers=1,
                attention_heads=a.heads,
                attention_kv_heads=a.heads if repeat_kv else a.kv_heads,
                attention_head_dim=h // a.heads,
                attention_value_head_dim=h // a.heads,
            )  # fmt: skip
        )
    logits = tokens * v
    head_mm = tokens * 2 * h * v / mm
    if pricing is None:
        head_mm = _linear_s(spec, gemm_tokens or tokens, h, v, True, tp, tokens)[0]
    loss_fwd, loss_bwd = LOSS_BYTES_PER_LOGIT[loss]
    head_fwd = head_mm + logits * loss_fwd / mem
    units.append(
        UnitProfile(
            name="head",
            kind="LMHead",
            forward_s=head_fwd,
            backward_s=2 * head_mm + logits * loss_bwd / mem,
            parameter_count=0 if a.tied else v * h + h,
            parameter_bytes=(0 if a.tied else v * h + h) * BF16,
            # tied: Megatron keeps the embedding's copy on the last stage too
            # saved: the head's input and the loss's fp32 (log-)softmax; the peak adds the
            # loss's transient (_LOSS_PEAK_BYTES)
            activation_bytes=int(norm_bytes + hidden_bytes + logits * 4),
            peak_bytes=int(norm_bytes + hidden_bytes + logits * _LOSS_PEAK_BYTES[loss]),
            # torch's ColwiseParallel saves the all-gathered input (torchtitan's output layer)
            tp_gathered_input_bytes=hidden_bytes if head == "torchtitan" else 0,
            forward_flops=tokens * 2 * h * v,
            backward_flops=tokens * 4 * h * v,
            tp_parameter_count=v * h,
            tp_compute_fraction=1.0,
            tp_collective_bytes=int((2 * hidden_bytes + logits * BF16) / 4),
            # the logits a gathered head all-gathers; loss parallel keeps them sharded
            tp_gathered_output_bytes=int(logits * BF16),
            linear_forward_flops=tokens * 2 * h * v if fp8_head else 0.0,
        )  # fmt: skip
    )
    for unit in units:
        unit.tp_sequence_dim = sequence_dim
    if a.tied:  # the last stage holds its own copy of the tied weight (Megatron's)
        units[-1].parameter_count = v * h
        units[-1].parameter_bytes = v * h * BF16
    cuts = [hidden_bytes] * (len(units) - 1)
    degrees = [t for t in (2, 4, 8) if a.heads % t == 0 and a.kv_heads % t == 0]
    return Profile(
        units=units, cut_bytes=cuts, batch_size=batch_size, device=spec.name, dtype="bfloat16",
        model=a.name, mode="analytic", input_bytes=tokens * 8, bytes_per_parameter=BF16,
        optimizer="mixed-adam", tp_plan={"layers.*": "megatron"} if degrees else {},
        tp_degrees=degrees, sequence_length=seq,
    )  # fmt: skip


# ----- forcing a run -----


@dataclass
class Outcome:
    run: Run
    missing: list[str] = field(default_factory=list)
    plan: Plan | None = None
    error: str = ""
    tokens_per_gpu_s: float = 0.0
    memory_gib: float = 0.0

    @property
    def throughput_ratio(self) -> float | None:
        return self.tokens_per_gpu_s / self.run.published_tokens_per_gpu_s if self.plan else None

    @property
    def memory_ratio(self) -> float | None:
        if self.plan is None or self.run.published_memory_gib is None:
            return None
        return self.memory_gib / self.run.published_memory_gib


def profile_of(run: Run) -> Profile:
    spec = get_device(run.gpu)
    return transformer_profile(
        run.arch, run.seq, spec, compiled=run.compiled, flash=run.flash,
        selective="torchtitan" if run.key.startswith("tt") else "megatron",
        gemm_tokens=(run.microbatch or 1) * run.seq, tp=run.tp,
        loss=loss_of(run),
        attention_kernel=kernel_for_trainer(trainer_of(run)),
        eager=trainer_of(run) if trainer_of(run) in ("torchtitan", "megatron") else "generic",
        repeat_kv=trainer_of(run) == "torchtitan",
        sequence_dim=1 if trainer_of(run) == "torchtitan" else 0,
        norm="fused" if run.fused_norm else "eager",
        head="torchtitan" if trainer_of(run) == "torchtitan" else "generic",
    )  # fmt: skip


def loss_of(run: Run) -> str:
    """How ``run``'s cross-entropy holds the logits (:data:`_LOSS_PEAK_BYTES`): torchtitan's
    ``cross_entropy(pred.float())`` under torch's ``loss_parallel()`` where it has TP (its
    ``ParallelDims.loss_parallel_enabled``: TP on and ``disable_loss_parallel`` unset, the
    default), plain torch without; the Llama 3 paper's unpublished trainer as plain torch;
    Megatron's fused vocab-parallel loss."""
    if trainer_of(run) == "torchtitan":
        return "torch-loss-parallel" if run.tp > 1 else "torch"
    return "torch" if run.key.startswith("llama3") else "megatron"


def trainer_of(run: Run) -> str | None:
    """The trainer that ran ``run``: torchtitan's tables, Megatron (Megatron-Core with
    Transformer Engine, SC21's Megatron-LM, BLOOM's Megatron-DeepSpeed), or None (the Llama 3
    paper's Meta trainer, unpublished: the default kernel)."""
    if run.key.startswith("tt"):
        return "torchtitan"
    if run.key.startswith(("mcore", "sc21", "bloom")):
        return "megatron"
    return None


def optimizer_step_of(run: Run) -> dict[str, str]:
    """How ``run``'s trainer runs the optimizer step (``PlanRequest.optimizer_kernel`` and
    ``grad_clip``, docs/cost-model.md "The optimizer step"): torchtitan at 9dec370 torch's
    foreach AdamW (torchtitan/optimizer.py: ``"foreach": not fused``, ``--optimizer.fused``
    off) after ``clip_grad_norm_(..., foreach=True)`` (train.py, ``max_norm`` 1.0); Megatron
    (Megatron-Core, SC21's Megatron-LM, BLOOM's Megatron-DeepSpeed) a fused Adam (Apex /
    Transformer Engine / DeepSpeed ``FusedAdam``) after its grad-norm pass; the Llama 3
    paper's unpublished trainer at torch's defaults."""
    trainer = trainer_of(run)
    if trainer == "torchtitan":
        return {"optimizer_kernel": "foreach", "grad_clip": "torch"}
    if trainer == "megatron":
        return {"optimizer_kernel": "fused", "grad_clip": "megatron"}
    return {"optimizer_kernel": "foreach", "grad_clip": "none"}


def cp_method_of(run: Run) -> str:
    """How the run's CP exchanges keys and values (``PlanRequest.context_parallel_method``):
    the Llama 3 paper's gathers K and V once (section 3.3.2: ``all_gather``); torchtitan runs
    torch's ring, traced into each block's ``torch.compile(fullgraph=True)`` graph when
    compiled (``ring_compiled``, docs/cost-model.md "Compiled"), else eager (``ring``)."""
    if run.key.startswith("llama3"):
        return "all_gather"
    return "ring_compiled" if run.compiled and trainer_of(run) == "torchtitan" else "ring"


def request_of(run: Run, **changes: object) -> PlanRequest:
    """The run's published configuration as a PlanRequest (memory unlimited: the plan is
    priced whatever it needs, and its predicted peak compared with the published one)."""
    spec = get_device(run.gpu)
    device = Device.from_spec(spec, memory_bytes=10**15)
    replica = run.global_batch // run.dp
    micro: int | str = replica // run.microbatch if run.microbatch else "auto"
    inter = run.inter_node_bandwidth_bytes_per_s or spec.inter_node_bandwidth_bytes_per_s
    fields: dict[str, object] = dict(
        cluster=Cluster([device] * run.gpus), batch_size=run.global_batch, microbatches=micro,
        schedule=run.schedule if run.pp > 1 else "1f1b",
        virtual_stages=run.virtual_stages if run.pp > 1 else 1,
        checkpoint="always" if run.recompute == "full" else "never",
        tensor_parallel=run.tp, data_parallel=run.dp,
        shard=run.shard if run.dp * run.cp > 1 else "none", gpus_per_node=spec.gpus_per_node,
        inter_node_bandwidth_bytes_per_s=inter, headroom=0.0, baselines=False,
        optimizer="mixed-adam",
    )  # fmt: skip
    have = _request_fields()
    options: dict[str, object] = {
        "precision": run.precision,
        "selective_recompute": run.recompute == "selective",
        "sequence_parallel": run.sequence_parallel,
        "tp_comm_overlap": run.tp_overlap,
        # torchtitan's async TP leaves the backward's reduce-scatters exposed
        "tp_overlap_backward": trainer_of(run) != "torchtitan",
        "grad_reduce_overlap": run.grad_overlap,
        "reshard_after_forward": not run.fsdp_under_pp,
        "grad_reduce_fp32": run.grad_reduce_fp32,
        "fp32_grad_buffer": run.fp32_grad_buffer,
        "context_parallel": run.cp,
        "context_parallel_method": cp_method_of(run),
        # every run's trainer keeps the logits sharded over TP: torchtitan's loss parallel is
        # on by default (0.2.2's job_config.py: disable_loss_parallel = False; 0.3.0 has no
        # switch), Megatron-LM / Megatron-Core / Megatron-DeepSpeed always compute
        # vocab_parallel_cross_entropy; the Llama 3 paper's trainer is unpublished
        # (assumed so: its TP is Megatron's, paper section 3.3.2)
        "loss_parallel": True,
        **optimizer_step_of(run),
    }
    fields.update({k: v for k, v in options.items() if k in have})
    fields.update(changes)
    return PlanRequest(**fields)  # type: ignore[arg-type]


def _plan_published(run: Run) -> Plan:
    """The plan of ``run``'s published configuration. Where the run does not publish its
    micro-batch count (SC21, Megatron-Core), the trainer still ran one that fit its GPUs: the
    fastest count whose plan fits the GPU's memory less the search's headroom (as
    :func:`search` sees memory), and only where none fits, the fastest at any memory (the
    search then lists the published configuration as not fitting)."""
    profile = profile_of(run)
    if not run.microbatch:
        spec = get_device(run.gpu)
        fitted = request_of(
            run, cluster=Cluster([Device.from_spec(spec)] * run.gpus), headroom=SEARCH_HEADROOM
        )
        try:
            return plan(profile, fitted)
        except (PlanningError, RuleViolation):
            pass
    return plan(profile, request_of(run))


def price(run: Run) -> Outcome:
    """Force ``run`` through the planner and compare (or list what it is missing)."""
    out = Outcome(run, missing_features(run))
    if out.missing:
        return out
    try:
        p = _plan_published(run)
    except (PlanningError, RuleViolation) as exc:
        out.error = str(exc).splitlines()[0]
        return out
    out.plan = p
    out.tokens_per_gpu_s = p.throughput * run.seq / run.gpus
    peak = p.mesh.peak_bytes if p.mesh is not None else max(p.rank_peak_bytes)
    out.memory_gib = peak / GIB
    return out


def _ratio(x: float | None) -> str:
    return "   -  " if x is None else f"{x:6.3f}"


def summary(outcomes: Sequence[Outcome]) -> str:
    ratios = [o.throughput_ratio for o in outcomes if o.throughput_ratio is not None]
    mems = [o.memory_ratio for o in outcomes if o.memory_ratio is not None]
    if not ratios:
        return "priced 0 runs"

    def within(xs: list[float], tol: float) -> int:
        return sum(abs(x - 1) <= tol for x in xs)

    text = (
        f"priced {len(ratios)} of {len(outcomes)} runs: throughput within 15% {within(ratios, 0.15)}, "
        f"within 20% {within(ratios, 0.20)}, median {statistics.median(ratios):.3f}, "
        f"range {min(ratios):.3f}..{max(ratios):.3f}"
    )
    if mems:
        text += (
            f"; memory ({len(mems)} published) within 20% {within(mems, 0.20)}, "
            f"median {statistics.median(mems):.3f}, range {min(mems):.3f}..{max(mems):.3f}"
        )
    return text


def _config(run: Run) -> str:
    return (f"pp {run.pp} x dp {run.dp} x tp {run.tp} ({run.shard}, {run.schedule}"
            f"{f' v{run.virtual_stages}' if run.virtual_stages > 1 else ''})")  # fmt: skip


def line(o: Outcome) -> str:
    r = o.run
    if o.missing:
        return f"{r.key:34s} not expressible: {', '.join(o.missing)}"
    if o.plan is None:
        return f"{r.key:34s} refused: {o.error}"
    mem = (f"memory {o.memory_gib:5.1f} / {r.published_memory_gib:5.1f} GiB = {_ratio(o.memory_ratio)}"
           if r.published_memory_gib is not None else f"memory {o.memory_gib:5.1f} GiB")  # fmt: skip
    return (
        f"{r.key:34s} tokens/s/GPU {o.tokens_per_gpu_s:9.1f} / {r.published_tokens_per_gpu_s:9.1f}"
        f" = {_ratio(o.throughput_ratio)}  {mem}  [{_config(r)}, M={o.plan.microbatches}]"
    )


SEARCH_HEADROOM = 0.10
"""The auto search plans with the planner's default headroom (10% of memory kept free for the
CUDA context, NCCL's buffers and the allocator): a pick must fit as a user's plan would."""

SEARCH_TIME_LIMIT_S = 10.0
"""Per pipeline solve of the search (``PlanRequest.time_limit_s``; the exact DP ignores it)."""


SEARCH_MARGIN = 0.15
"""The predicted speedup a pick must beat to count as a win over the published configuration:
the benchmark's throughput goal (every run within 15%), the accuracy asked of the model."""


@dataclass
class Pick:
    """The auto mesh search's pick on one published run, beside the published configuration."""

    run: Run
    published: Plan | None = None
    pick: Plan | None = None
    error: str = ""
    seconds: float = 0.0
    """Wall-clock seconds the search took (this machine)."""
    published_gib: float = 0.0
    """The published configuration's predicted peak per GPU."""
    published_fits: bool = True
    """The published configuration fits the GPU's memory less the search's headroom."""

    @property
    def speedup(self) -> float | None:
        """Predicted step of the published configuration over the pick's (> 1: the pick is
        predicted faster)."""
        if self.published is None or self.pick is None:
            return None
        return self.published.iteration_time_s / self.pick.iteration_time_s

    @property
    def beyond_band(self) -> bool:
        """The pick is predicted faster by more than :data:`SEARCH_MARGIN`: a win the model's
        accuracy can carry. A smaller predicted gain is a tie at that accuracy: the
        published configuration is as good by this model."""
        return (self.speedup or 1.0) > 1.0 + SEARCH_MARGIN

    @property
    def same(self) -> bool:
        r, p = self.run, self.pick
        return (
            p is not None
            and p.mesh_shape == (r.pp, r.dp, r.tp)
            and (p.shard == (r.shard if r.dp > 1 else "none") or r.dp == 1)
        )


def search(run: Run, time_limit_s: float = SEARCH_TIME_LIMIT_S) -> Pick:
    """The auto mesh search (T, D, sharding and M free; the GPUs, global batch, sequence,
    schedule, re-materialization and trainer options the run's) with the GPU's real memory
    and the planner's default headroom, beside the published configuration forced."""
    t0 = time.perf_counter()
    out = Pick(run)
    forced = price(run)
    out.published = forced.plan
    if forced.plan is None:
        out.error = "published configuration not priced"
        return out
    spec = get_device(run.gpu)
    usable = spec.memory_bytes * (1 - SEARCH_HEADROOM)
    out.published_gib = forced.memory_gib
    out.published_fits = forced.memory_gib * GIB <= usable
    req = request_of(
        run, tensor_parallel="auto", data_parallel="auto", shard="auto", microbatches="auto",
        cluster=Cluster([Device.from_spec(spec)] * run.gpus), headroom=SEARCH_HEADROOM,
        time_limit_s=time_limit_s,
    )  # fmt: skip
    try:
        out.pick = plan(profile_of(run), req)
    except (PlanningError, RuleViolation) as exc:
        out.error = str(exc).splitlines()[0]
    out.seconds = time.perf_counter() - t0
    return out


SEARCH_CASE_CAP_S = 120.0
"""Wall-clock seconds one run's search may take in ``--search`` before it is stopped and
listed as over the cap (the 405B runs on 512 to 16384 GPUs weigh the most meshes)."""


def _search_child(run: Run, time_limit_s: float, out: Any) -> None:
    out.put(search(run, time_limit_s))


def search_capped(
    run: Run, time_limit_s: float = SEARCH_TIME_LIMIT_S, cap_s: float = SEARCH_CASE_CAP_S
) -> Pick:
    """:func:`search` in a child process stopped after ``cap_s`` seconds (then the Pick has
    no pick and says so); where processes cannot fork, in this one, uncapped."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return search(run, time_limit_s)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_search_child, args=(run, time_limit_s, queue), daemon=True)
    t0 = time.perf_counter()
    child.start()
    try:
        return cast(Pick, queue.get(timeout=cap_s))
    except queue_module.Empty:
        pk = Pick(run, error=f"search stopped at the {cap_s:.0f} s cap")
        pk.seconds = time.perf_counter() - t0
        return pk
    finally:
        if child.is_alive():
            child.terminate()
        child.join()


def step_parts(p: Plan) -> dict[str, float]:
    """A mesh plan's step in parts (seconds): the average rank's compute, its re-computation,
    the busiest rank's TP collectives, the exposed DP communication (gradient reduction and
    parameter gathers), the pipeline bubble (what is left of the pipeline's time)."""
    m = p.mesh
    row = m.candidates[0] if m is not None and m.candidates else None
    if row is None:
        return {}
    recompute = sum(s.recompute_s for s in p.stages) * p.microbatches / p.mesh_shape[0]
    pipeline = row.pipeline_s or p.iteration_time_s
    busy = row.tp_comm_s + row.gather_s
    return {
        "compute": max(pipeline - busy - (row.bubble_s or 0.0) - recompute, 0.0),
        "recompute": recompute,
        "TP comm": row.tp_comm_s,
        "DP comm": row.dp_comm_s + row.gather_s,
        "bubble": row.bubble_s or 0.0,
    }


def why(pk: Pick) -> str:
    """Why the pick wins: the published configuration does not fit, or the step part the pick
    saves most on, both figures given (published vs pick)."""
    if pk.pick is None or pk.published is None:
        return pk.error
    if pk.same:
        return "the published configuration"
    note = "" if pk.published_fits else (
        f"published needs {pk.published_gib:.1f} GiB,"
        f" over {get_device(pk.run.gpu).memory_bytes * (1 - SEARCH_HEADROOM) / GIB:.1f} usable; "
    )  # fmt: skip
    a, b = step_parts(pk.published), step_parts(pk.pick)
    if not a or not b:
        return note.rstrip("; ")
    diffs = {k: a[k] - b[k] for k in a}
    k = max(diffs, key=lambda x: diffs[x])
    worse = min(diffs, key=lambda x: diffs[x])
    if (pk.speedup or 1.0) < 1.0:  # only memory moved it: say what the fitting pick pays
        return f"{note}the fastest that fits pays {worse}: {_secs(b[worse])} vs {_secs(a[worse])}"
    text = f"{note}less {k}: {_secs(a[k])} vs {_secs(b[k])} per step"
    if diffs[worse] < -1e-3:  # a millisecond: float noise is no price paid
        text += f" (pays {worse}: {_secs(b[worse])} vs {_secs(a[worse])})"
    if pk.run.tp_overlap:
        # the planner reports TP collectives before overlap, so the overlapped share sits in
        # neither part: the published "compute" reads low by it
        text += "; TP comm before overlap"
    return text


def _secs(x: float) -> str:
    """Seconds to three figures; below a microsecond (float noise) 0."""
    return "0 s" if abs(x) < 1e-6 else f"{x:.3g} s"


def _shape(p: Plan) -> str:
    pp, dp, tp = p.mesh_shape
    v = f" v{p.virtual_stages}" if p.virtual_stages > 1 else ""
    return f"pp {pp} x dp {dp} x tp {tp} ({p.shard}, {p.schedule}{v}, M={p.microbatches})"


def search_line(pk: Pick) -> str:
    r = pk.run
    if pk.pick is None:
        return f"{r.key:34s} search: {pk.error} ({pk.seconds:.1f} s)"
    same = "= published" if pk.same else f"{pk.speedup:.3f}x"
    if not pk.same and pk.published_fits and not pk.beyond_band:
        same += f" (a tie within {SEARCH_MARGIN:.0%})"
    return (f"{r.key:34s} published {_config(r)} | pick {_shape(pk.pick)} {same}; {why(pk)}"
            f" [{pk.seconds:.1f} s]")  # fmt: skip


def search_summary(picks: Sequence[Pick]) -> str:
    done = [pk for pk in picks if pk.pick is not None]
    if not done:
        return f"searched 0 of {len(picks)} runs"
    gains = [pk.speedup or 1.0 for pk in done]
    same = sum(pk.same for pk in done)
    unfit = sum(not pk.published_fits for pk in done)
    moved = [pk for pk in done if not pk.same and pk.published_fits]
    wins = sum(pk.beyond_band for pk in moved)
    return (
        f"searched {len(done)} of {len(picks)} runs in {sum(pk.seconds for pk in picks):.0f} s: "
        f"published configuration picked {same}, published does not fit {unfit}, "
        f"a pick faster by over {SEARCH_MARGIN:.0%} {wins}, a tie within {SEARCH_MARGIN:.0%} "
        f"{len(moved) - wins}; "
        f"predicted speedup of the pick median {statistics.median(gains):.3f}, "
        f"range {min(gains):.3f}..{max(gains):.3f}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated run keys (prefixes)")
    ap.add_argument("--search", action="store_true", help="also run the auto mesh search")
    ap.add_argument(
        "--time-limit", type=float, default=SEARCH_TIME_LIMIT_S,
        help="seconds per pipeline solve in --search (default %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--case-cap", type=float, default=SEARCH_CASE_CAP_S,
        help="wall-clock seconds one run's search may take in --search (default %(default)s)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    runs = RUNS
    if args.only:
        keys = args.only.split(",")
        runs = [r for r in RUNS if any(r.key.startswith(k) for k in keys)]
    outcomes = []
    for r in runs:
        o = price(r)
        outcomes.append(o)
        print(line(o), flush=True)
    print(summary(outcomes))
    lacking: dict[str, list[str]] = {}
    for o in outcomes:
        for m in o.missing:
            lacking.setdefault(m, []).append(o.run.key)
    for m, keys in lacking.items():
        print(f"not expressible ({len(keys)}): {m}: {', '.join(keys)}")
    if args.search:
        picks = []
        for o in outcomes:
            if o.plan is not None:
                picks.append(search_capped(o.run, args.time_limit, args.case_cap))
                print(search_line(picks[-1]), flush=True)
        print(search_summary(picks))
    return 0


SOURCES: dict[str, Callable[[Arch, int], float]] = {
    "megatron_sc21": megatron_sc21_flops_per_token,
    "megatron_core": megatron_core_flops_per_token,
}

if __name__ == "__main__":
    raise SystemExit(main())
