"""Bytes torch.compile's generated kernels move in a torchtitan Llama 3 block (CPU inductor).

    .venv/bin/python benchmarks/compiled_block_bytes.py [--ac none|selective|full|all]
        [--float8 off|on|both]

The block is written here from the facts of torchtitan's Llama model code at 9dec370
(torchtitan/models/llama/model.py, torchtitan/models/norms.py; the code is not copied):
``h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h))``, RMSNorm in
fp32 (``(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).type_as(x) * weight``), q/k/v
from three bias-free linears, rotary embedding in complex fp32 (``view_as_complex`` of
``x.float()`` times ``freqs_cis``, ``view_as_real``, ``type_as``), ``repeat_kv`` (unsqueeze,
expand, reshape) of k and v to every query head, causal SDPA on ``[b, heads, s, d]``, the
output's ``transpose(1, 2).contiguous()``, ``wo``, and SwiGLU ``w2(silu(w1(x)) * w3(x))``; all
in bf16 (FSDP2's ``param_dtype``), each block compiled as torchtitan's ``apply_compile`` does
(``torch.compile(block, fullgraph=True)``) after its activation checkpointing
(``_apply_ac_to_transformer_block``: ``full``, the whole block re-computed; ``selective``, its
``op`` policy: the outputs of SDPA and of every other ``mm`` saved, the rest re-computed).

What is read: inductor's own count of each scheduled (fused) kernel's traffic,
``GraphLowering.count_bytes`` (each buffer a kernel reads or writes once, at its size; the
count behind ``torch._inductor.metrics.num_bytes_accessed``), for the forward graph and the
backward graph, without the extern kernels (the matmuls and SDPA, priced on their own). Every
count is at two sequence lengths and the difference taken, so that what does not scale with the
tokens (the norm weights, their gradients) drops out: bytes per token. :func:`fit` solves the
per-token bytes for their coefficients of ``h``, ``kv`` (the k/v width, ``kv_heads x d``) and
``ffn`` from three shapes; ``benchmarks/published_runs.py``'s
``TORCHTITAN_COMPILED_BYTES_PER_TOKEN`` holds the result and ``tests/test_compiled_block_bytes.py``
checks it against a fresh measurement at other dims.

``--float8 on``: the same block with its seven linears converted as torchtitan's Float8
converter does (torchao's ``convert_to_float8_training``, tensorwise dynamic scaling, the
default recipe; torchtitan's filter skips only the model's ``output`` head, outside the block)
before the activation checkpointing and the compile, as torchtitan orders them. Its
``_scaled_mm`` calls are extern kernels, left out as the matmuls are; what remains beyond the
bf16 block is the casts: each tensor's ``max(abs)`` and its FP8 copies (the ``float8_*`` rows
of ``TORCHTITAN_COMPILED_BYTES_PER_TOKEN``). The weights' amax and casts do not scale with the
tokens: :func:`fit` also fits each graph's bytes without a token dimension as coefficients of
the weight elements (:data:`FIXED_TERMS`), constant in the sequence length (checked at 61 and
67 tokens). torchao 0.18.0 here; the 0.7.0 release, torchtitan 9dec370's time, runs on this
torch too (``PYTHONPATH`` to a ``pip install --no-deps --target`` folder) and measures the
same forward, ``6 h + 8`` bytes per token less backward.

Where a GPU's inductor may differ: the scheduler (what fuses with what) is shared, but the CPU
(C++/OpenMP) backend decides its own vertical fusions (``CppScheduling.can_fuse_vertical``)
where triton's ``SIMDScheduling`` does, and triton-only options do not apply here
(``config.triton.*``: e.g. ``mix_order_reduction``, which fuses RMSNorm backward's
per-token and per-weight reductions on newer torch; ``split_reductions``). The count is of
buffers per kernel, not of cache behaviour: it is what a memory-bound kernel moves either way.
"""

from __future__ import annotations

import argparse
import functools
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

AC_MODES = ("none", "selective", "full")


class _RMSNorm(nn.Module):
    """torchtitan's eager-form RMSNorm: normalized in fp32, cast back, times the weight."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [b, s, heads, d] by complex ``freqs`` [s, d / 2] (complex64),
    in fp32 complex arithmetic, returned in ``x``'s dtype."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(pairs * freqs.view(1, x.shape[1], 1, -1)).flatten(3)
    return rotated.type_as(x)


class LlamaBlock(nn.Module):
    """A torchtitan Llama 3 TransformerBlock: ``dim`` wide, ``heads`` query heads of
    ``dim / heads``, ``kv_heads`` key/value heads, SwiGLU of ``ffn``."""

    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attention_norm, self.ffn_norm = _RMSNorm(dim), _RMSNorm(dim)
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        b, s, n, d = x.shape
        rep = self.heads // self.kv_heads
        if rep == 1:
            return x
        return x.unsqueeze(3).expand(b, s, n, rep, d).reshape(b, s, n * rep, d)

    def _attention(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = _rotary(q, freqs), _rotary(k, freqs)
        k, v = self._repeat(k), self._repeat(v)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self._attention(self.attention_norm(x), freqs)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


_SAVED = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    # torchtitan 9dec370's _save_list keeps these "for low precision training": the float8
    # casts' max(abs(x)) (none in a bf16 block)
    torch.ops.aten.abs.default,
    torch.ops.aten.max.default,
}


def _selective_policy() -> Any:
    """torchtitan's ``op`` selective AC policy: SDPA's and every other ``mm``'s outputs saved
    (the 1st, 3rd, ... mm of the forward, and of the re-computation), the rest re-computed.
    CPU's SDPA op is ``_scaled_dot_product_flash_attention_for_cpu``: saved likewise."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _SAVED | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        key = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[key] += 1
        keep = func in saved and not (func == torch.ops.aten.mm.default and counts[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _wrapped(block: nn.Module, ac: str) -> nn.Module:
    """``block`` under torchtitan's activation checkpointing ``ac`` (its checkpoint wrapper,
    ``preserve_rng_state=False``)."""
    if ac == "none":
        return block
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if ac == "full":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    return checkpoint_wrapper(block, context_fn=_selective_policy, preserve_rng_state=False)


@dataclass(frozen=True)
class GraphBytes:
    """One compiled graph's memory-bound kernels on ``tokens`` tokens: the bytes they read and
    write of tensors with a token dimension (each buffer once per kernel), how many kernels
    (inductor's fused ones, and eager fallbacks that compute: the complex rotary product), and
    the extern kernels left out (matmuls, SDPA, views)."""

    bytes: int
    tokens: int
    kernels: int
    fallbacks: tuple[str, ...]
    externs: tuple[str, ...]
    fixed_bytes: int = 0
    """The same kernels' traffic in buffers without a token dimension (weights, their
    gradients, per-tensor scales): what a float8 block's weight casts move, per graph call."""

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.tokens


def _graph_bytes(graph: Any, tokens: int) -> GraphBytes:
    """Inductor's per-kernel count (``get_read_write_buffer_accesses``, what ``count_bytes``
    sums) over ``graph``'s scheduled nodes: generated kernels and computing fallbacks, not the
    matmuls, SDPA or views; only buffers whose bytes are a multiple of ``tokens`` (a prime
    above every element size, so that a weight, a weight's gradient or a per-kernel partial
    sum, whose sizes are products of the widths, never is)."""
    from torch._inductor.ir import FallbackKernel
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

    total, fixed, kernels, fallbacks, externs = 0, 0, 0, [], []
    for node in graph.scheduler.nodes:
        if isinstance(node, NopKernelSchedulerNode):
            continue
        if isinstance(node, ExternKernelSchedulerNode):
            op = getattr(node.node, "op_overload", None)
            name = str(op if op is not None else getattr(node.node, "python_kernel_name", ""))
            if (
                not isinstance(node.node, FallbackKernel)
                or op is None
                or getattr(op, "is_view", False)
                or "scaled_dot_product" in name
                # full AC's partitioner wraps SDPA (the only op torch tags random here) so
                # that its re-computation replays the RNG state: SDPA still
                or "rng_state" in name
            ):
                externs.append(name)
                continue
            fallbacks.append(name)
        accesses = node.get_read_write_buffer_accesses(include_reads=True, include_writes=True)
        total += sum(count for count in accesses.values() if count % tokens == 0)
        fixed += sum(count for count in accesses.values() if count % tokens != 0)
        kernels += 1
    return GraphBytes(total, tokens, kernels, tuple(fallbacks), tuple(externs), fixed)


def _compiled_graphs(fn: Any, tokens: int) -> list[GraphBytes]:
    """Run ``fn`` (which compiles), recording each graph inductor lowers, in order (the
    forward, then the backward)."""
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    seen: list[GraphBytes] = []
    original = GraphLowering.compile_to_module

    @functools.wraps(original)
    def recording(self: Any) -> Any:
        out = original(self)
        with V.set_graph_handler(self):
            seen.append(_graph_bytes(self, tokens))
        return out

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    GraphLowering.compile_to_module = recording  # type: ignore[method-assign]
    try:
        with (
            inductor_config.patch(fx_graph_cache=False),
            functorch_config.patch(enable_autograd_cache=False),
        ):
            torch._dynamo.reset()
            fn()
    finally:
        GraphLowering.compile_to_module = original  # type: ignore[method-assign]
    return seen


SEQ = 61
"""Tokens of a measurement: a prime (see :func:`_graph_bytes`)."""


def _float8(block: nn.Module) -> nn.Module:
    """``block`` with every linear a torchao ``Float8Linear`` as torchtitan's float8 converter
    swaps them (``convert_to_float8_training``; its filter skips only the model's ``output``
    head, outside the block) in its default recipe, tensorwise dynamic scaling: each matmul's
    input and weight (forward), and output gradient (backward), scaled by ``max(abs(x))`` of
    the whole tensor and cast to FP8 before ``torch._scaled_mm``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    out: nn.Module = convert_to_float8_training(block, config=Float8LinearConfig())
    return out


def measure_bytes(
    dim: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    ac: str = "none",
    seq: int = SEQ,
    float8: bool = False,
) -> tuple[GraphBytes, GraphBytes]:
    """Forward and backward graphs of one compiled block on one sequence of ``seq`` tokens;
    ``float8``: its linears converted first (:func:`_float8`, needs torchao), as torchtitan
    converts the model before its activation checkpointing and compile."""
    torch.manual_seed(0)
    block: nn.Module = LlamaBlock(dim, heads, kv_heads, ffn).to(torch.bfloat16)
    if float8:
        block = _float8(block)
    block = _wrapped(block, ac)
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(1, seq, dim, dtype=torch.bfloat16, requires_grad=True)
    angles = torch.outer(torch.arange(seq).float(), torch.rand(dim // heads // 2))
    freqs = torch.polar(torch.ones_like(angles), angles)

    def step() -> None:
        compiled(x, freqs).sum().backward()

    graphs = _compiled_graphs(step, seq)
    if len(graphs) != 2:
        raise RuntimeError(f"expected a forward and a backward graph, got {len(graphs)}")
    return graphs[0], graphs[1]


def bytes_per_token(
    dim: int, heads: int, kv_heads: int, ffn: int, ac: str = "none", float8: bool = False
) -> tuple[float, float]:
    """Forward and backward bytes per token of a compiled block's memory-bound kernels."""
    fwd, bwd = measure_bytes(dim, heads, kv_heads, ffn, ac, float8=float8)
    return fwd.bytes_per_token, bwd.bytes_per_token


FIT_SHAPES = (
    (256, 4, 2, 512),
    (512, 8, 2, 1024),
    (256, 4, 2, 1024),
    (512, 8, 4, 512),
    (256, 8, 2, 512),
    (512, 4, 2, 1024),
    (384, 6, 3, 768),
)
"""(dim, heads, kv_heads, ffn): shapes that separate the terms of :data:`TERMS` (grouped-query
attention throughout, as Llama 3's: ``repeat_kv`` copies only where ``kv_heads < heads``; at
least two key/value heads: with one, inductor lays the repeated k and v out otherwise, and
(256, 4, 1, 512) measures 15,880 / 24,624 bytes per token forward / backward against the
formula's 15,624 / 23,344, 256 and 1,280 more: ``4 kv`` and ``20 kv``)."""

TERMS = ("h", "kv", "ffn", "heads", "head_dim", "1")
"""What bytes per token are a sum of: the widths ``h``, ``kv`` (``kv_heads x head_dim``) and
``ffn``; ``heads`` (SDPA's per-head log-sum-exp and its backward's per-head sums),
``head_dim`` (rotary's ``freqs``, ``head_dim / 2`` complex per token) and a constant (the
norms' per-token ``rsqrt``)."""


def terms(dim: int, heads: int, kv_heads: int, ffn: int) -> list[int]:
    """The values of :data:`TERMS` for one shape."""
    head_dim = dim // heads
    return [dim, kv_heads * head_dim, ffn, heads, head_dim, 1]


def weight_elements(dim: int, heads: int, kv_heads: int, ffn: int) -> int:
    """Elements of a block's linear weights (wq, wk, wv, wo, w1, w3, w2): what a float8
    block casts, each forward, per weight element."""
    kv = kv_heads * (dim // heads)
    return dim * (dim + 2 * kv) + dim * dim + 3 * dim * ffn


FIXED_TERMS = ("weights", "h", "1")
"""What a graph's bytes without a token dimension are a sum of: the linears' weight elements
(:func:`weight_elements`: a float8 block's amax and casts of its weights), ``h`` (the norms'
weights and their gradients) and a constant (per-tensor scales)."""


@dataclass(frozen=True)
class Fit:
    """:func:`fit`'s result: bytes per token forward and backward as coefficients of
    :data:`TERMS`, the graphs' bytes without a token dimension as coefficients of
    :data:`FIXED_TERMS`, and the largest residual of each (bytes; 0: exactly linear)."""

    forward: list[float]
    backward: list[float]
    worst_per_token: float
    fixed_forward: list[float]
    fixed_backward: list[float]
    worst_fixed: float


def _lstsq(rows: list[list[int]], y: list[float]) -> tuple[list[float], float]:
    a = torch.tensor(rows, dtype=torch.float64)
    target = torch.tensor(y, dtype=torch.float64).unsqueeze(1)
    sol = torch.linalg.lstsq(a, target).solution
    worst = float((a @ sol - target).abs().max())
    return [round(float(v), 3) for v in sol.squeeze(1)], worst


def fit(ac: str = "none", float8: bool = False) -> Fit:
    """Forward and backward bytes per token as coefficients of :data:`TERMS` (least squares
    over :data:`FIT_SHAPES`, one more shape than terms), and the bytes that do not scale with
    the tokens as coefficients of :data:`FIXED_TERMS`."""
    rows, fixed_rows = [], []
    fwd: list[float] = []
    bwd: list[float] = []
    fixed_fwd: list[float] = []
    fixed_bwd: list[float] = []
    for dim, heads, kv_heads, ffn in FIT_SHAPES:
        f, b = measure_bytes(dim, heads, kv_heads, ffn, ac, float8=float8)
        print(
            f"  ac {ac} float8 {float8} shape {(dim, heads, kv_heads, ffn)}: forward "
            f"{f.bytes_per_token:g} backward {b.bytes_per_token:g} per token, fixed "
            f"{f.fixed_bytes} / {b.fixed_bytes}",
            flush=True,
        )
        rows.append(terms(dim, heads, kv_heads, ffn))
        fixed_rows.append([weight_elements(dim, heads, kv_heads, ffn), dim, 1])
        fwd.append(f.bytes_per_token)
        bwd.append(b.bytes_per_token)
        fixed_fwd.append(f.fixed_bytes)
        fixed_bwd.append(b.fixed_bytes)
    (f_c, f_w), (b_c, b_w) = _lstsq(rows, fwd), _lstsq(rows, bwd)
    (ff_c, ff_w), (fb_c, fb_w) = _lstsq(fixed_rows, fixed_fwd), _lstsq(fixed_rows, fixed_bwd)
    return Fit(f_c, b_c, max(f_w, b_w), ff_c, fb_c, max(ff_w, fb_w))


def _formula(coefficients: list[float], names: tuple[str, ...] = TERMS) -> str:
    return " + ".join(f"{c:g} {t}" for c, t in zip(coefficients, names, strict=True) if c)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ac", choices=(*AC_MODES, "all"), default="all")
    parser.add_argument(
        "--float8",
        choices=("off", "on", "both"),
        default="off",
        help="the block's linears as torchtitan's Float8 converter swaps them (needs torchao)",
    )
    parser.add_argument("--verbose", action="store_true", help="each shape's kernels and externs")
    args = parser.parse_args()
    logging.getLogger("torch._inductor").setLevel(logging.ERROR)
    print(
        f"torch {torch.__version__}, inductor CPU backend; bytes per token of memory-bound kernels"
    )
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.float8]
    for float8 in modes:
        for ac in AC_MODES if args.ac == "all" else (args.ac,):
            tag = f"{'float8 ' if float8 else ''}ac {ac:9s}"
            if args.verbose:
                for dim, heads, kv_heads, ffn in FIT_SHAPES[:1]:
                    f, b = measure_bytes(dim, heads, kv_heads, ffn, ac, float8=float8)
                    print(f"  {tag} h {dim} forward {f}\n  {tag} h {dim} backward {b}")
            r = fit(ac, float8)
            print(f"{tag} forward  {_formula(r.forward)}", flush=True)
            print(
                f"{tag} backward {_formula(r.backward)}   (largest residual "
                f"{r.worst_per_token:.3f} B/token)"
            )
            print(f"{tag} fixed forward  {_formula(r.fixed_forward, FIXED_TERMS)}")
            print(
                f"{tag} fixed backward {_formula(r.fixed_backward, FIXED_TERMS)}   (largest "
                f"residual {r.worst_fixed:.3f} B)",
                flush=True,
            )


if __name__ == "__main__":
    main()
