"""Bytes Megatron-Core's GPT TransformerLayer moves in its memory-bound ops, fused as Megatron runs.

    .venv/bin/python benchmarks/megatron_block_bytes.py [--config sc21|mcore|all] [--verbose]
        [--json]

The layer is the installed megatron-core's own (``get_gpt_layer_local_spec()`` built with
``build_module(spec, config=TransformerConfig(...), layer_number=1)``), its parameters cast to
bf16 as Megatron's ``Float16Module`` casts the model, run on the CPU in one process (a gloo
group of one, ``parallel_state.initialize_model_parallel(1, 1)``), forward then backward with
a gradient from outside (as the next layer hands it on), counted by :class:`FusedBytes`:
:class:`eager_block_bytes.OpBytes`'s rule (each dispatched op one kernel reading its tensor
inputs and writing its outputs; views, allocations, matmuls and SDPA left out; ``baddbmm``,
the attention scores' matmul, left out with the other matmuls), except that each of
Megatron's fused kernels counts as ONE kernel, its tensor inputs read once and its outputs
written once, the ops that compute it on the CPU not counted (:func:`fused_kernels`, which
swaps them in for the measurement and restores them after):

- bias-GeLU, ``megatron/core/fusions/fused_bias_gelu.py``: ``bias_gelu(bias, y)`` (reads y
  and the bias, writes the activation) and its backward ``bias_gelu_back(g, bias, y)`` (reads
  g, y and the bias, writes the gradient), each a ``jit_fuser`` function (``torch.compile`` on
  torch >= 2.2, TorchScript's fuser before) inside ``GeLUFunction``; the bias gradient
  autograd sums from the returned ``[tokens, ffn]`` gradient is counted op by op, as
  Megatron runs it;
- bias-dropout-add, ``fused_bias_dropout.py``'s ``bias_dropout_add_fused_train``
  (``jit_fuser``: the forward and the backward graph each fused): forward reads x, the bias
  and the residual, writes the output and, with dropout, its keep mask (bool, 1 byte, as the
  fused graph saves it); backward reads the gradient and the mask, writes x's gradient (none
  without dropout: the gradient passes through) and the bias's; the residual's gradient is the
  incoming one;
- the causal softmax, ``fused_softmax.py``'s ``ScaledUpperTriangMaskedSoftmax``, whose CUDA
  extension does not exist on the CPU: counted as its kernel
  (``megatron/fused_kernels/scaled_upper_triang_masked_softmax.h`` in Megatron-LM, apex's
  ``csrc/megatron`` the same) runs: each row ``i`` of a head's scores read up to the diagonal
  in 4-element vectors (``element_index < local_seq``, ``local_seq = i + 1``; rows of more
  than 128 keys), the probabilities written whole (zeros above the diagonal); backward reads
  the gradient and the probabilities likewise up to the diagonal and writes the whole input
  gradient. ``FusedScaleMaskSoftmax.get_batch_per_block`` (a call into the CUDA extension)
  returns the kernel's launch figure (128 threads a block, 32-thread warps, one row a warp
  above 128 keys) so that Megatron's own ``is_kernel_available`` decides;
- the LayerNorm: the local spec's ``WrappedTorchNorm`` (apex absent) is ``torch.nn.LayerNorm``,
  one ``native_layer_norm`` op forward and one ``native_layer_norm_backward`` op backward,
  what apex's ``FusedLayerNorm`` and Transformer Engine's LayerNorm run as one kernel each
  (reading x, the weight and the bias, writing y and the per-row mean and inverse deviation;
  backward reading the gradient, x, the statistics and the weight): counted by the op rule,
  the statistics at fp32 (4 bytes a row, as CUDA's and apex's accumulate type; the CPU op
  writes them in bf16).

Dropout: ``torch.nn.functional.dropout`` (the attention dropout's ``nn.Dropout``) on the CPU
runs ``bernoulli_``, ``div_`` and ``mul`` (ATen's ``_dropout``: its one-kernel
``native_dropout`` is taken only on CUDA); the measurement runs it as on CUDA, one
``native_dropout`` kernel (reads x, writes the output and a bool mask) and one
``native_dropout_backward`` (reads the gradient and the mask, writes the input's gradient).

Everything else is Megatron's own Python, counted op by op: the QKV linear's bias add
(``output + bias`` in ``tensor_parallel/layers.py``) and its bias gradient
(``grad_output.sum(dim=0)``), the scores' ``baddbmm`` backward's ``alpha`` multiplies, the
attention dropout, the context's ``permute(2, 0, 1, 3).contiguous()`` copy.

CPU shims (the measurement only; nothing counted changes): ``DotProductAttention`` takes its
``baddbmm`` buffer from ``parallel_state.get_global_memory_buffer().get_tensor``, which
allocates on ``torch.cuda.current_device()``: the buffer is allocated on the CPU beforehand
(:func:`_cpu_buffer`), so ``get_tensor`` only slices it; the RNG tracker's ``fork`` (the CUDA
RNG state) is Megatron's inference tracker's no-op fork (``initialize_rng_tracker(
inference_rng_tracker=True)``).

Configurations (:data:`CONFIGS`): ``sc21``, the GPT layer of Megatron-LM's SC21 table and of
BLOOM's Megatron-DeepSpeed: hidden and attention dropout 0.1, the local (non-flash) core
attention with the fused causal softmax, LayerNorm, GeLU, biases; ``mcore``, Megatron-Core's
2024 table as ``benchmarks/published_runs.py`` configures its runs (no dropout, flash
attention): the same layer with both dropouts 0 and the core attention a causal SDPA call on
``[s, b, heads, d]`` as Transformer Engine's fused attention takes it (``sbhd``; left out
with the matmuls, :class:`_FlashCore`). Not as Transformer Engine's spec: its linears add the
QKV bias in the GEMM's epilogue and reduce its gradient with the weight gradient
(cuBLASLt ``BIAS`` / ``BGRADB``), where the local spec's ``output + bias`` and
``grad_output.sum(0)`` move ``12 h`` and ``6 h`` bytes per token more (measured here, in the
table).

Bytes per token: each shape is counted at several sequence lengths (:data:`SEQS`); between two
of them, ``(T(s2) - T(s1)) / (s2 - s1) = A + B heads (s1 + s2)`` where the per-token bytes at
sequence ``s`` are ``A + B heads s`` (the softmax and the attention dropout touch
``heads x s`` scores per token): :func:`fit` solves the pairs over :data:`FIT_SHAPES` for the
coefficients of :data:`TERMS` (``heads_seq`` is ``B``). Exact (no residual) over three
sequence lengths, i.e. linear in ``s``. ``benchmarks/published_runs.py``'s
``MEGATRON_FUSED_BYTES_PER_TOKEN`` holds the result and ``tests/test_megatron_block_bytes.py``
checks it against a fresh measurement at another shape.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import eager_block_bytes as eb
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

_aten = torch.ops.aten

MATMULS = frozenset({_aten.baddbmm.default})
"""Matmuls :data:`eager_block_bytes.PRICED_ELSEWHERE` lacks: the attention scores' ``baddbmm``
(priced with the attention, ``_attention_s``)."""

_STATS_BYTES = 4
"""Bytes of one LayerNorm per-row statistic (mean, inverse deviation) on CUDA and in apex:
fp32."""

_STACK: list[FusedBytes] = []


class FusedBytes(eb.OpBytes):
    """:class:`eager_block_bytes.OpBytes` that a fused kernel can pause (the ops computing it
    on the CPU are not counted; :func:`_kernel` counts it once) and that counts the
    LayerNorm's per-row statistics at fp32 (:data:`_STATS_BYTES`)."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = 0

    def __enter__(self) -> FusedBytes:
        _STACK.append(self)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _STACK.remove(self)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.paused or func in MATMULS:
            return func(*args, **kwargs)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name = str(func.overloadpacket.__name__)
        # the per-row statistics: fp32 on CUDA and in apex, the input's dtype on the CPU
        if func is _aten.native_layer_norm.default:
            stats = out[1:]
        elif func is _aten.native_layer_norm_backward.default:
            stats = args[3:5]
        else:
            stats = ()
        for t in stats:
            self.by_op[name] += t.numel() * _STATS_BYTES - eb.tensor_bytes(t)
        return out


@contextlib.contextmanager
def _uncounted() -> Iterator[None]:
    """The innermost :class:`FusedBytes` paused: a fused kernel's CPU computation."""
    mode = _STACK[-1] if _STACK else None
    if mode is not None:
        mode.paused += 1
    try:
        yield
    finally:
        if mode is not None:
            mode.paused -= 1


def _kernel(name: str, moved_bytes: int) -> None:
    """Count one fused kernel's bytes in the innermost :class:`FusedBytes`."""
    if _STACK and not _STACK[-1].paused:
        _STACK[-1].by_op[name] += moved_bytes


def _moved(*tensors: torch.Tensor | None) -> int:
    """Bytes of the distinct ``tensors`` (each read or written once)."""
    return sum(eb.tensor_bytes(t) for t in eb._tensors([t for t in tensors if t is not None]))


def _keep_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """A bool keep mask of ``x``'s shape (CUDA's ``native_dropout`` mask, 1 byte an element)."""
    return torch.rand(x.shape, dtype=torch.float32) >= p


class _NativeDropout(torch.autograd.Function):
    """Dropout as CUDA runs it: one ``native_dropout`` kernel (reads x, writes the output and
    a bool mask), backward one ``native_dropout_backward`` (reads the gradient and the mask,
    writes the input's gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, p: float) -> torch.Tensor:
        with _uncounted():
            keep = _keep_mask(x, p)
            out = x * keep * (1.0 / (1.0 - p))
        ctx.save_for_backward(keep)
        ctx.scale = 1.0 / (1.0 - p)
        _kernel("native_dropout", _moved(x, out, keep))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (keep,) = ctx.saved_tensors
        with _uncounted():
            grad_in = grad * keep * ctx.scale
        _kernel("native_dropout_backward", _moved(grad, keep, grad_in))
        return grad_in, None


def _dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """``torch.nn.functional.dropout`` as on CUDA (ATen's ``dropout``: the input itself at
    ``p = 0`` or in eval, else ``native_dropout``)."""
    if not training or p == 0.0 or input.numel() == 0:
        return input
    out: torch.Tensor = _NativeDropout.apply(input, p)
    return out


class _BiasDropoutAdd(torch.autograd.Function):
    """``bias_dropout_add_fused_train`` as one kernel each way: ``residual + dropout(x +
    bias)``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float
    ) -> torch.Tensor:
        with _uncounted():
            y = x if bias is None else x + bias
            keep = _keep_mask(y, p) if p > 0.0 else None
            if keep is not None:
                y = y * keep * (1.0 / (1.0 - p))
            out = residual + y
        ctx.scale = 1.0 / (1.0 - p)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(keep)
        _kernel("bias_dropout_add", _moved(x, bias, residual, out, keep))
        return out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, None]:
        (keep,) = ctx.saved_tensors
        with _uncounted():
            grad_x = grad if keep is None else grad * keep * ctx.scale
            grad_bias = grad_x.sum(dim=tuple(range(grad.dim() - 1))) if ctx.has_bias else None
        written = [t for t in (grad_x, grad_bias) if t is not None and t is not grad]
        _kernel("bias_dropout_add_backward", _moved(grad, keep) + _moved(*written))
        return grad_x, grad_bias, grad, None


def _bias_dropout_add(
    x_with_bias: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor, prob: float
) -> torch.Tensor:
    x, bias = x_with_bias
    residual = residual if residual.dtype == x.dtype else residual.to(x.dtype)
    out: torch.Tensor = _BiasDropoutAdd.apply(x, bias, residual, prob)
    return out


def _one_kernel(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` (a ``jit_fuser`` function, called inside an autograd Function) as one kernel:
    its un-compiled body run uncounted, its tensor arguments read and its output written
    once."""
    # torch.compile's wrapper keeps the Python function it compiles; run that, uncompiled
    body: Callable[..., torch.Tensor] = getattr(
        fn, "_torchdynamo_orig_callable", getattr(fn, "__wrapped__", fn)
    )

    def kernel(*args: Any) -> torch.Tensor:
        with _uncounted():
            out = body(*args)
        _kernel(name, _moved(*[a for a in args if isinstance(a, torch.Tensor)]) + _moved(out))
        return out

    return kernel


def causal_read_elements(sk: int) -> int:
    """Elements of one head's ``sk x sk`` scores the causal softmax kernel reads: row ``i`` up
    to its diagonal (``i + 1`` elements) in whole loads of 4 elements where a row has at least
    4 per warp lane (more than 64 keys), else 1."""
    pow2 = 1 << (sk - 1).bit_length()
    per_load = 4 if pow2 // min(pow2, 32) >= 4 else 1
    return sum(per_load * math.ceil((i + 1) / per_load) for i in range(sk))


def _batch_per_block(sq: int, sk: int, b: int, np: int) -> int:
    """The causal softmax kernel's rows a thread block: 128 threads in warps of
    ``min(32, pow2(sk))`` lanes, two rows a warp up to 128 keys, else one."""
    pow2 = 1 << (sk - 1).bit_length()
    return (128 // min(pow2, 32)) * (2 if pow2 <= 128 else 1)


class _UpperTriangSoftmax(torch.autograd.Function):
    """``ScaledUpperTriangMaskedSoftmax`` on the CPU, counted as its CUDA kernel moves bytes
    (:func:`causal_read_elements` read, the whole ``[attn_batches, sq, sk]`` written)."""

    @staticmethod
    def forward(ctx: Any, inputs: torch.Tensor, scale: float) -> torch.Tensor:
        batches, sq, sk = inputs.shape
        with _uncounted():
            causal = torch.ones(sq, sk, dtype=torch.bool).triu(1)
            scores = (inputs.float() * scale).masked_fill(causal, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(inputs.dtype)
        ctx.save_for_backward(probs)
        ctx.scale = scale
        read = batches * causal_read_elements(sk) * inputs.element_size()
        _kernel("scaled_upper_triang_masked_softmax", read + eb.tensor_bytes(probs))
        return probs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (probs,) = ctx.saved_tensors
        batches, _, sk = probs.shape
        with _uncounted():
            g, y = grad.float(), probs.float()
            grad_in = (ctx.scale * y * (g - (g * y).sum(-1, keepdim=True))).to(grad.dtype)
        read = batches * causal_read_elements(sk) * (grad.element_size() + probs.element_size())
        _kernel("scaled_upper_triang_masked_softmax_backward", read + eb.tensor_bytes(grad_in))
        return grad_in, None


@contextlib.contextmanager
def fused_kernels() -> Iterator[None]:
    """Megatron-Core's fused functions swapped for their one-kernel counts (and dropout for
    CUDA's ``native_dropout``) for the duration, restored after."""
    from megatron.core.fusions import fused_bias_dropout, fused_bias_gelu, fused_softmax

    patches: list[tuple[Any, str, Any]] = [
        (fused_bias_gelu, "bias_gelu", _one_kernel("bias_gelu", fused_bias_gelu.bias_gelu)),
        (
            fused_bias_gelu,
            "bias_gelu_back",
            _one_kernel("bias_gelu_back", fused_bias_gelu.bias_gelu_back),
        ),
        (fused_bias_dropout, "bias_dropout_add_fused_train", _bias_dropout_add),
        (fused_softmax, "ScaledUpperTriangMaskedSoftmax", _UpperTriangSoftmax),
        (
            fused_softmax.FusedScaleMaskSoftmax,
            "get_batch_per_block",
            staticmethod(_batch_per_block),
        ),
        (torch.nn.functional, "dropout", _dropout),
    ]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, new in patches:
            setattr(owner, name, new)
        yield
    finally:
        for owner, name, old in saved:
            setattr(owner, name, old)


class _FlashCore(nn.Module):
    """A flash core attention in Megatron's core-attention interface: ``[s, b, heads, d]``
    q, k and v (``sbhd``, as Transformer Engine's fused attention takes them) to ``[s, b,
    heads x d]`` through one causal SDPA call (left out, as the matmuls)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> torch.Tensor:
        s, b, heads, d = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


CONFIGS = ("sc21", "mcore")
"""``sc21``: dropout 0.1 and the local core attention; ``mcore``: no dropout, flash
attention."""


def gloo_world() -> None:
    """This process as a gloo world of one (a TP group of one for Megatron's collectives and
    torch's ``DTensor``), unless one is up already."""
    if not dist.is_initialized():
        # an in-process store: no port, so two counts can run at once (CI's two workers)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def megatron_world() -> None:
    """:func:`gloo_world`, Megatron's model-parallel state of one rank, its no-op RNG
    tracker."""
    gloo_world()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _cpu_buffer(elements: int) -> None:
    """Megatron's global ``baddbmm`` buffer allocated on the CPU beforehand, so that
    ``get_tensor`` slices it instead of allocating on ``torch.cuda.current_device()``."""
    from megatron.core import parallel_state

    buffers = parallel_state.get_global_memory_buffer().buffer
    key = ("mpu", torch.bfloat16)
    if key not in buffers or buffers[key].numel() < elements:
        buffers[key] = torch.empty(elements, dtype=torch.bfloat16)


def build_layer(config: str, hidden: int, heads: int, ffn: int) -> nn.Module:
    """Megatron-Core's local-spec GPT TransformerLayer for ``config`` (:data:`CONFIGS`), bf16."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    if config not in CONFIGS:
        raise ValueError(f"unknown config {config!r}; one of {', '.join(CONFIGS)}")
    megatron_world()
    dropout = 0.1 if config == "sc21" else 0.0
    spec = get_gpt_layer_local_spec()
    if config == "mcore":
        spec.submodules.self_attention.submodules.core_attention = _FlashCore
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=ffn,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        bf16=True,
        params_dtype=torch.bfloat16,
        add_bias_linear=True,
        bias_activation_fusion=True,
        bias_dropout_fusion=True,
        masked_softmax_fusion=True,
        use_cpu_initialization=True,
    )
    torch.manual_seed(0)
    layer: nn.Module = build_module(spec, config=cfg, layer_number=1)
    return layer.bfloat16()


def measure(
    config: str, hidden: int, heads: int, ffn: int, seq: int
) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes per op of one layer's forward and backward on one sequence of ``seq`` tokens
    (``[seq, 1, hidden]``, Megatron's ``[s, b, h]``)."""
    layer = build_layer(config, hidden, heads, ffn)
    _cpu_buffer(heads * seq * seq)
    x = torch.randn(seq, 1, hidden, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(seq, 1, hidden, dtype=torch.bfloat16)
    with fused_kernels():
        with FusedBytes() as fwd:
            out = layer(x, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        with FusedBytes() as bwd:
            out.backward(grad)
    return dict(fwd.by_op), dict(bwd.by_op)


SEQS = (144, 208, 272)
"""Sequence lengths each shape is counted at: multiples of 4 above 128 keys (the causal
softmax kernel's conditions, and its 4-element loads)."""

FIT_SHAPES = (
    (128, 4, 512),
    (256, 4, 512),
    (128, 8, 768),
    (256, 8, 1024),
    (192, 4, 256),
)
"""(hidden, heads, ffn): shapes that separate :data:`TERMS` (heads a multiple of 4: the
causal kernel's rows a block)."""

TERMS = ("h", "ffn", "heads_seq", "heads", "1")
"""What bytes per token are a sum of: the widths ``h`` and ``ffn``; ``heads_seq``, ``heads x
s`` (the scores the softmax and the attention dropout touch per token); ``heads`` (the
causal kernel's loads past the diagonal, up to 4 a row); a constant (the LayerNorms'
statistics)."""


REPLICATED = ("native_layer_norm", "bias_dropout_add")
"""Forward ops outside the TP regions (the LayerNorms, the bias-dropout-adds): what tensor
parallelism without sequence parallelism runs whole on every rank (the ``replicated`` graph of
:func:`fit`)."""

GRAPHS = ("forward", "backward", "replicated")


def pair_bytes(
    config: str, hidden: int, heads: int, ffn: int, s1: int, s2: int
) -> dict[str, float]:
    """``(T(s2) - T(s1)) / (s2 - s1)`` of each of :data:`GRAPHS` (``T``: the bytes of one
    layer on one sequence): ``A + B heads (s1 + s2)``, i.e. the per-token bytes ``A + B heads
    s`` at ``s = s1 + s2``."""
    (f1, b1), (f2, b2) = (measure(config, hidden, heads, ffn, s) for s in (s1, s2))
    rep1, rep2 = (sum(f.get(op, 0) for op in REPLICATED) for f in (f1, f2))
    return {
        "forward": (sum(f2.values()) - sum(f1.values())) / (s2 - s1),
        "backward": (sum(b2.values()) - sum(b1.values())) / (s2 - s1),
        "replicated": (rep2 - rep1) / (s2 - s1),
    }


def fit(config: str, verbose: bool = False) -> tuple[dict[str, list[float]], float]:
    """Each of :data:`GRAPHS`' bytes per token as coefficients of :data:`TERMS`: least
    squares over the consecutive :data:`SEQS` pairs of :data:`FIT_SHAPES`, and the largest
    residual (bytes per token; 0: exactly linear in the terms and in ``s``)."""
    rows: list[list[int]] = []
    ys: dict[str, list[float]] = {g: [] for g in GRAPHS}
    for hidden, heads, ffn in FIT_SHAPES:
        for s1, s2 in zip(SEQS, SEQS[1:], strict=False):
            pair = pair_bytes(config, hidden, heads, ffn, s1, s2)
            rows.append([hidden, ffn, heads * (s1 + s2), heads, 1])
            for g in GRAPHS:
                ys[g].append(pair[g])
            if verbose:
                print(f"  {config} {(hidden, heads, ffn)} s {s1}->{s2}: {pair}", flush=True)
    if verbose:
        for s in SEQS[:2]:
            fwd, bwd = measure(config, *FIT_SHAPES[0], s)
            print(f"  {config} {FIT_SHAPES[0]} s {s} forward ops {fwd}\n    backward ops {bwd}")
    a = torch.tensor(rows, dtype=torch.float64)
    worst = 0.0
    out: dict[str, list[float]] = {}
    for g in GRAPHS:
        target = torch.tensor(ys[g], dtype=torch.float64).unsqueeze(1)
        sol = torch.linalg.lstsq(a, target).solution
        worst = max(worst, float((a @ sol - target).abs().max()))
        out[g] = [round(float(v), 3) for v in sol.squeeze(1)]
    return out, worst


def _formula(coefficients: list[float]) -> str:
    return " + ".join(f"{c:g} {t}" for c, t in zip(coefficients, TERMS, strict=True) if c)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=(*CONFIGS, "all"), default="all")
    parser.add_argument("--verbose", action="store_true", help="each pair's and op's bytes")
    parser.add_argument("--json", action="store_true", help="print {config: {graph: {term: c}}}")
    parser.add_argument(
        "--pair",
        metavar="H,HEADS,FFN,S1,S2",
        help="print {config: {graph: (T(s2) - T(s1)) / (s2 - s1)}} of one shape (JSON)",
    )
    args = parser.parse_args()
    configs = CONFIGS if args.config == "all" else (args.config,)
    if args.pair:
        h, heads, ffn, s1, s2 = (int(v) for v in args.pair.split(","))
        print(json.dumps({c: pair_bytes(c, h, heads, ffn, s1, s2) for c in configs}))
        dist.destroy_process_group()
        return
    out: dict[str, dict[str, dict[str, float]]] = {}
    for config in configs:
        coefficients, worst = fit(config, args.verbose)
        out[config] = {
            g: {t: c for t, c in zip(TERMS, coefficients[g], strict=True) if c} for g in GRAPHS
        }
        if not args.json:
            for g in GRAPHS:
                print(f"{config:6s} {g:10s} {_formula(coefficients[g])}", flush=True)
            print(f"{config:6s} largest residual {worst:.3f} B/token")
    if args.json:
        print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
