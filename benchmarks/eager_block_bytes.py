"""Bytes torchtitan's Llama 3 block moves in its memory-bound ops when it runs eagerly.

    .venv/bin/python benchmarks/eager_block_bytes.py [--ac none|selective|full|all] [--verbose]
        [--norm eager|fused]

The block is :class:`compiled_block_bytes.LlamaBlock` (written there from the facts of
torchtitan 9dec370's Llama model code), run here without ``torch.compile``, as torchtitan's
runs without ``--training.compile`` do: bf16 (FSDP2's ``param_dtype``), forward then backward
with a gradient from outside (as the next block hands it on), under each activation
checkpointing mode torchtitan offers (:data:`compiled_block_bytes.AC_MODES`, its wrapper).

What is counted: every aten op the block's forward and backward dispatch (what a
``TorchDispatchMode`` sees: the ops a composite such as ``reshape`` or ``contiguous``
decomposes into, autograd's backward formulas and its gradient sums, a selective checkpoint's
re-computation), each one kernel reading its tensor inputs and writing its outputs, each
tensor at its element count times its element size, a broadcast tensor (a stride-0 dimension,
``expand``) at the elements it addresses (so the norm weight or the rotary ``freqs`` are read at
their own size, not the broadcast shape). Left out, by :func:`moved_bytes`:

- the matmuls and attention (:data:`PRICED_ELSEWHERE`: ``mm``, ``addmm``, ``bmm``,
  ``_scaled_mm`` and the SDPA kernels, forward and backward), priced at their own shapes;
- ops that write nothing: every output shares its storage with an input and the op does not
  mutate (``func._schema.is_mutable``) one of its arguments, i.e. a view, alias or metadata
  op (``view``, ``_unsafe_view``, ``expand``, ``t``, ``transpose``, ``unsqueeze``, ``squeeze``,
  ``view_as_real``, ``view_as_complex``, ``detach``, ``_conj``...): decided per call by the
  storages, not by a list of names, so a ``reshape`` that copies is counted and one that
  views is not;
- allocations that launch no kernel (:data:`ALLOCATIONS`: ``empty``, ``empty_like``,
  ``empty_strided``).

An in-place op (``add_``, as autograd may sum gradients) is counted: it reads its inputs and
writes the mutated one. Every count is at two sequence lengths and the difference taken, so
what does not scale with the tokens (the norm weights and their gradients, the weight
matmuls' transposes) drops out: bytes per token, fitted over
:data:`compiled_block_bytes.FIT_SHAPES` to the coefficients of
:data:`compiled_block_bytes.TERMS` (:func:`fit`); ``benchmarks/published_runs.py``'s
``TORCHTITAN_EAGER_BYTES_PER_TOKEN`` holds the result and ``tests/test_eager_block_bytes.py``
checks it against a fresh measurement at other dims. With one key/value head (TP 8 ranks of
Llama 3, none of torchtitan's eager runs) ``repeat_kv``'s reshape is a view, not a copy: 4 h + 4
kv bytes per token less forward than the table ((256, 4, 1, 512): 33,584 against 34,864),
backward the same.

What the dispatch count is not: a GPU's own kernels' cache behaviour, or the copies a kernel
makes inside its implementation (SDPA's, left out with it). The ops dispatched are the same on
CPU and CUDA except SDPA's (``_scaled_dot_product_flash_attention_for_cpu`` here,
``_scaled_dot_product_flash_attention`` on an H100): both return the attention output in the
query's ``[b, s, heads, d]`` memory layout, so torchtitan's ``transpose(1, 2).contiguous()``
after it is a view on either.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import compiled_block_bytes as cb
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_aten = torch.ops.aten

PRICED_ELSEWHERE = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten._scaled_mm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_flash_attention_backward.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_efficient_attention_backward.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        _aten._scaled_dot_product_cudnn_attention_backward.default,
    }
)
"""Ops priced at their own shapes (``_block_linears_s``, ``_attention_s`` in
``benchmarks/published_runs.py``), not as memory traffic."""

ALLOCATIONS = frozenset(
    {
        _aten.empty.memory_format,
        _aten.empty_like.default,
        _aten.empty_strided.default,
    }
)
"""Ops that allocate an output without writing it: no kernel."""


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements ``t`` addresses: its element count without its stride-0
    (broadcast) dimensions, times its element size."""
    if t.numel() == 0:
        return 0
    elements = math.prod(n for n, s in zip(t.shape, t.stride(), strict=True) if s != 0)
    return elements * t.element_size()


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in ``tree`` (an op's arguments or outputs), each once (a tensor passed
    twice is one read)."""
    seen: dict[tuple[Any, ...], torch.Tensor] = {}
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor):
            key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
            seen.setdefault(key, t)
    return list(seen.values())


def moved_bytes(func: Any, args: Any, kwargs: Any, out: Any) -> int | None:
    """Bytes one dispatched op moves (its tensor inputs read plus its outputs written, at
    :func:`tensor_bytes`), or None where it launches no memory-bound kernel: priced elsewhere
    (:data:`PRICED_ELSEWHERE`), an allocation (:data:`ALLOCATIONS`), or a view (every output
    in an input's storage and no argument mutated)."""
    if func in PRICED_ELSEWHERE or func in ALLOCATIONS:
        return None
    inputs, outputs = _tensors((args, kwargs)), _tensors(out)
    storages = {t.untyped_storage().data_ptr() for t in inputs}
    mutates = func._schema.is_mutable
    if not mutates and all(o.untyped_storage().data_ptr() in storages for o in outputs):
        return None
    return sum(tensor_bytes(t) for t in inputs) + sum(tensor_bytes(t) for t in outputs)


class OpBytes(TorchDispatchMode):
    """A dispatch mode summing :func:`moved_bytes` over the ops it sees, per op name."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: dict[str, int] = defaultdict(int)

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        moved = moved_bytes(func, args, kwargs, out)
        if moved is not None:
            name = str(func.overloadpacket.__name__)
            self.by_op[name] += moved
        return out


@dataclass(frozen=True)
class PassBytes:
    """Bytes the forward and backward of one block moved on ``tokens`` tokens, and the ops
    that moved them (name -> bytes)."""

    forward: int
    backward: int
    tokens: int
    forward_ops: dict[str, int]
    backward_ops: dict[str, int]


NORMS = ("eager", "fused")
"""How the block's two RMSNorms run: ``eager``, torchtitan's ``rmsnorm`` op by op (its Llama 3
configs at 9dec370); ``fused``, its ``fused_rmsnorm`` Triton kernels (:class:`_FusedRMSNorm`),
the ``norm_type`` of its April 2024 configs (torchtitan 157a12c56, ``train_configs/*.toml``),
which its 64-A100 runs in docs/performance.md used."""


class _FusedRMSNorm(torch.autograd.Function):
    """torchtitan's ``fused_rmsnorm`` (torchtitan/models/norms.py at 157a12c56,
    ``TritonFusedRMSNorm``) as its two Triton kernels move bytes, each counted once: the
    forward reads a row of ``x`` and the weight and writes the row of ``y`` (``x``'s dtype) and
    its fp32 ``rstd``; the backward reads ``x``, ``dy``, the weight and ``rstd`` and writes
    ``dx``, and per-SM fp32 partial weight gradients that do not grow with the tokens (left
    out: the count is a difference over tokens). The arithmetic runs uncounted on the CPU."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        import megatron_block_bytes as mb

        with mb._uncounted():
            x32 = x.float()
            rstd = torch.rsqrt(x32.pow(2).mean(-1) + eps)
            y = (x32 * rstd.unsqueeze(-1) * weight.float()).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        mb._kernel("fused_rms_norm", mb._moved(x, weight, y, rstd))
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        import megatron_block_bytes as mb

        x, weight, rstd = ctx.saved_tensors
        with mb._uncounted():
            x32, dy32, w32 = x.float(), dy.float(), weight.float()
            normed = x32 * rstd.unsqueeze(-1)
            g = dy32 * w32
            dx32 = rstd.unsqueeze(-1) * (g - normed * (g * normed).mean(-1, keepdim=True))
            dx = dx32.to(x.dtype)
            dw = (dy32 * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        mb._kernel("fused_rms_norm_backward", mb._moved(dy, x, weight, rstd, dx))
        return dx, dw, None


def _fuse_norms(block: nn.Module) -> None:
    """Swap ``block``'s RMSNorms (:class:`compiled_block_bytes._RMSNorm`) for
    :class:`_FusedRMSNorm`, in place."""
    for module in block.modules():
        if isinstance(module, cb._RMSNorm):
            norm = module

            def forward(x: torch.Tensor, norm: cb._RMSNorm = norm) -> torch.Tensor:
                out: torch.Tensor = _FusedRMSNorm.apply(x, norm.weight, norm.eps)
                return out

            norm.forward = forward  # type: ignore[method-assign]


def measure_bytes(
    dim: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    ac: str = "none",
    seq: int = cb.SEQ,
    norm: str = "eager",
) -> PassBytes:
    """One eager block (``ac``'s checkpointing, ``norm``'s RMSNorm: :data:`NORMS`) forward and
    backward on one sequence of ``seq`` tokens, counted by :class:`OpBytes` (the backward's
    gradient given, as the next block hands it on: not a ``.sum()`` of the output, whose
    gradient would be broadcast); with the fused norm by ``megatron_block_bytes.FusedBytes``,
    the :class:`OpBytes` that counts a fused kernel once."""
    if norm not in NORMS:
        raise ValueError(f"norm {norm!r}: one of {NORMS}")
    torch.manual_seed(0)
    plain = cb.LlamaBlock(dim, heads, kv_heads, ffn).to(torch.bfloat16)
    if norm == "fused":
        _fuse_norms(plain)
    block = cb._wrapped(plain, ac)
    x = torch.randn(1, seq, dim, dtype=torch.bfloat16, requires_grad=True)
    angles = torch.outer(torch.arange(seq).float(), torch.rand(dim // heads // 2))
    freqs = torch.polar(torch.ones_like(angles), angles)
    grad = torch.randn(1, seq, dim, dtype=torch.bfloat16)
    counter: type[OpBytes] = OpBytes
    if norm == "fused":
        import megatron_block_bytes as mb

        counter = mb.FusedBytes
    with counter() as fwd:
        out = block(x, freqs)
    with counter() as bwd:
        out.backward(grad)
    return PassBytes(fwd.total, bwd.total, seq, dict(fwd.by_op), dict(bwd.by_op))


SEQS = (cb.SEQ, 2 * cb.SEQ)
"""The two sequence lengths whose difference is counted."""


def bytes_per_token(
    dim: int, heads: int, kv_heads: int, ffn: int, ac: str = "none", norm: str = "eager"
) -> tuple[float, float]:
    """Forward and backward bytes per token of an eager block's memory-bound ops: the
    difference between :data:`SEQS`' counts over the difference in tokens."""
    short, long = (measure_bytes(dim, heads, kv_heads, ffn, ac, seq, norm) for seq in SEQS)
    tokens = long.tokens - short.tokens
    return (long.forward - short.forward) / tokens, (long.backward - short.backward) / tokens


def fit(ac: str = "none", norm: str = "eager") -> tuple[list[float], list[float], float]:
    """Forward and backward bytes per token as coefficients of
    :data:`compiled_block_bytes.TERMS`: least squares over
    :data:`compiled_block_bytes.FIT_SHAPES`, and the largest residual, bytes per token (0: the
    counts are exactly linear in the terms)."""
    rows, fwd, bwd = [], [], []
    for shape in cb.FIT_SHAPES:
        f, b = bytes_per_token(*shape, ac=ac, norm=norm)
        print(f"  ac {ac} norm {norm} shape {shape}: forward {f:g} backward {b:g}", flush=True)
        rows.append(cb.terms(*shape))
        fwd.append(f)
        bwd.append(b)
    a = torch.tensor(rows, dtype=torch.float64)
    worst = 0.0

    def solve(y: list[float]) -> list[float]:
        nonlocal worst
        target = torch.tensor(y, dtype=torch.float64).unsqueeze(1)
        sol = torch.linalg.lstsq(a, target).solution
        worst = max(worst, float((a @ sol - target).abs().max()))
        return [round(float(v), 3) for v in sol.squeeze(1)]

    return solve(fwd), solve(bwd), worst


def fsdp_float8_weight_bytes(elements: int = 4096 * 61) -> tuple[float, float, dict[str, int]]:
    """Bytes per weight element of torchtitan's Float8 FSDP recipe (docs/float8.md at 9dec370:
    ``--float8.enable_fsdp_float8_all_gather --float8.precompute_float8_dynamic_scale_for_fsdp``)
    on one rank's fp32 shard of ``elements``, counted by :class:`OpBytes` as FSDP2 runs it,
    eagerly (its pre-all-gather hook is outside the compiled block): per all-gather, torchao's
    ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`` with the precomputed scale
    (the scale's ``mul``, ``clamp``, the FP8 copy); per step, the amax that
    ``precompute_float8_dynamic_scale_for_fsdp`` takes (``_foreach_norm(inf)`` of the shards).
    Returns (per all-gather, per step, the all-gather's bytes per op). Needs torchao."""
    import math

    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    torch.manual_seed(0)
    shard = torch.randn(elements, dtype=torch.float32)
    with OpBytes() as amax:
        (norm,) = torch._foreach_norm([shard], ord=math.inf)
    scale = (torch.finfo(torch.float8_e4m3fn).max / norm.clamp(1e-12)).float()
    weight = WeightWithDynamicFloat8CastTensor(shard, LinearMMConfig(), torch.float8_e4m3fn, scale)
    with OpBytes() as cast:
        weight.fsdp_pre_all_gather(None)
    # the scalar outputs (the norm, the scale read) are a few bytes: whole bytes per element
    return cast.total // elements, amax.total // elements, dict(cast.by_op)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ac", choices=(*cb.AC_MODES, "all"), default="all")
    parser.add_argument("--verbose", action="store_true", help="each op's bytes per token")
    parser.add_argument(
        "--norm",
        choices=NORMS,
        default="eager",
        help="the RMSNorm: torchtitan's eager rmsnorm or its fused_rmsnorm kernels (April 2024)",
    )
    parser.add_argument(
        "--fsdp-float8",
        action="store_true",
        help="bytes per weight element of torchtitan's float8 FSDP all-gather casts instead",
    )
    args = parser.parse_args()
    if args.fsdp_float8:
        gather, step, ops = fsdp_float8_weight_bytes()
        print(f"float8 FSDP all-gather: {gather:g} bytes per shard element per all-gather {ops}")
        print(f"float8 FSDP amax: {step:g} bytes per shard element per step")
        return
    print(f"torch {torch.__version__}, eager; bytes per token of memory-bound ops")
    for ac in cb.AC_MODES if args.ac == "all" else (args.ac,):
        if args.verbose:
            short, long = (
                measure_bytes(*cb.FIT_SHAPES[0], ac=ac, seq=seq, norm=args.norm) for seq in SEQS
            )
            tokens = long.tokens - short.tokens
            for phase in ("forward_ops", "backward_ops"):
                a, b = getattr(short, phase), getattr(long, phase)
                per = {op: (b[op] - a.get(op, 0)) / tokens for op in b}
                print(f"  ac {ac} {cb.FIT_SHAPES[0]} {phase}: {per}")
        fwd, bwd, worst = fit(ac, args.norm)
        print(f"ac {ac:9s} forward  {cb._formula(fwd)}", flush=True)
        print(f"ac {ac:9s} backward {cb._formula(bwd)}   (largest residual {worst:.3f} B/token)")


if __name__ == "__main__":
    main()
