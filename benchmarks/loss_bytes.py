"""Bytes per logit the trainers' cross-entropy losses move in their memory-bound ops.

    .venv/bin/python benchmarks/loss_bytes.py [--verbose]

Each loss is run as its trainer calls it, on bf16 logits (the output projection's, under bf16
training), forward to the loss and backward to the logits' gradient, counted op by op with
``eager_block_bytes``'s dispatch-level rule (each op one kernel reading its tensor inputs and
writing its outputs; views, allocations and the collectives left out), except where an op
addresses its input sparsely (:data:`SPARSE`):

- ``torch``: ``F.cross_entropy(logits.float(), labels)``, torchtitan's loss at 9dec370
  (``cross_entropy_loss`` in ``train.py``; the Llama 3 paper's runs are priced the same);
- ``torch-loss-parallel``: the same call on logits sharded over the vocabulary (a ``DTensor``
  ``Shard(-1)``) under torch's ``loss_parallel()``, as torchtitan runs it with TP (its
  ``_log_softmax`` / ``_nll_loss`` handlers: max, shift, exp, sum and log as separate ops, and a
  backward that rebuilds the softmax);
- ``megatron``: Megatron-Core's ``tensor_parallel.vocab_parallel_cross_entropy`` (the
  installed release; its default, ``cross_entropy_loss_fusion=False``): ``.float()``, max,
  in-place shift, in-place exp, sum, in-place division by the sum, saved as the softmax; the
  backward scatters ``-1`` at the targets and multiplies by the incoming gradient in place.
  Megatron-LM's 2021 ``mpu.vocab_parallel_cross_entropy`` (SC21, BLOOM's Megatron-DeepSpeed)
  runs the same ops on ``output.float()``.

One process, a TP group of one (gloo): a rank's share of the vocabulary is what each op
touches, so the bytes per logit of a rank's shard are those of one rank. Every count is at two
vocabulary sizes and the difference taken over the logits' difference: what scales with the
tokens only (the per-token max, sum and loss, the targets) drops out. The collectives'
bytes (three fp32 values per token) are not here (``docs/cost-model.md``, loss parallel).
``benchmarks/published_runs.py``'s ``LOSS_BYTES_PER_LOGIT`` holds the result and
``tests/test_loss_bytes.py`` checks it against a fresh count.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import eager_block_bytes as eb
import megatron_block_bytes as mb
import torch
import torch.distributed as dist
import torch.nn.functional as F

_aten = torch.ops.aten

LOSSES = ("torch", "torch-loss-parallel", "megatron")
TOKENS = 61
VOCABS = (512, 1024)
"""The two vocabulary sizes whose difference is counted (``TOKENS`` rows each)."""

SPARSE = frozenset(
    {
        _aten.nll_loss_forward.default,
        _aten.gather.default,
        _aten.index.Tensor,
        _aten.index_put_.default,
        _aten.index_put.default,
    }
)
"""Ops that read (or write) one element per row of their full-size operand: the kernel moves
its output and its indices, and the full-size operand only at the output's element count."""

FILLS = frozenset({_aten.zeros_like.default, _aten.ones_like.default, _aten.full_like.default})
"""Ops that write their output without reading their input (only its shape)."""


def _sparse_bytes(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """What :data:`SPARSE` and ``nll_loss_backward`` ops move: every input and output but the
    full-size ones (the logits-sized operand), each of those at the small tensors' rows."""
    tensors = eb._tensors((args, kwargs))
    outputs = eb._tensors(out)
    if func is _aten.nll_loss_backward.default:
        # zero-fills its full-size output and writes one element per row: the fill only
        grad_input = outputs[0]
        return eb.tensor_bytes(grad_input) + sum(
            eb.tensor_bytes(t) for t in tensors if t.numel() < grad_input.numel()
        )
    largest = max(t.numel() for t in [*tensors, *outputs])
    small = [t for t in [*tensors, *outputs] if t.numel() < largest]
    rows = max((t.numel() for t in small), default=0)
    full = [t for t in tensors if t.numel() == largest]
    return sum(eb.tensor_bytes(t) for t in small) + sum(rows * t.element_size() for t in full)


class LossBytes(eb.OpBytes):
    """:class:`eager_block_bytes.OpBytes` over plain tensors: a ``DTensor`` op is left to
    ``DTensor``, which dispatches its local ops here again; the fake tensors of its sharding
    propagation and the collectives run uncounted."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if any(issubclass(t, (DTensor, AsyncCollectiveTensor)) for t in types):
            return NotImplemented
        if any(issubclass(t, FakeTensor) for t in types) or func.namespace in (
            "_c10d_functional",
            "c10d_functional",
            "_c10d_functional_autograd",
            "_dtensor",
        ):
            return func(*args, **kwargs)
        if func in SPARSE or func is _aten.nll_loss_backward.default:
            out = func(*args, **kwargs)
            self.by_op[str(func.overloadpacket.__name__)] += _sparse_bytes(func, args, kwargs, out)
            return out
        if func in FILLS:
            out = func(*args, **kwargs)
            self.by_op[str(func.overloadpacket.__name__)] += sum(
                eb.tensor_bytes(t) for t in eb._tensors(out)
            )
            return out
        return super().__torch_dispatch__(func, types, args, kwargs)


def loss_parallel_context() -> Any:
    """torch's ``loss_parallel()``: its backward handlers apply only inside it too."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _loss_fn(kind: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``kind``'s loss of ``[tokens, V]`` bf16 logits against ``[tokens]`` labels."""
    if kind == "torch":
        return lambda logits, labels: F.cross_entropy(logits.float(), labels)
    if kind == "torch-loss-parallel":
        from torch.distributed.tensor.parallel import loss_parallel

        def parallel(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            with loss_parallel():
                return F.cross_entropy(logits.float(), labels)

        return parallel
    if kind == "megatron":
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        mb.megatron_world()
        # Megatron's logits are [s, b, V]; the loss is averaged over the tokens after
        return lambda logits, labels: vocab_parallel_cross_entropy(
            logits.unsqueeze(1), labels.unsqueeze(1)
        ).mean()
    raise ValueError(f"unknown loss {kind!r}; one of {', '.join(LOSSES)}")


def measure(kind: str, vocab: int, tokens: int = TOKENS) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes per op of ``kind``'s forward (logits to the loss) and backward (to the logits'
    gradient) on ``tokens`` rows of ``vocab`` logits."""
    mb.gloo_world()
    torch.manual_seed(0)
    fn = _loss_fn(kind)
    logits = torch.randn(tokens, vocab, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,))
    if kind == "torch-loss-parallel":
        # the logits sharded over the vocabulary, the labels whole, as torchtitan's TP leaves them
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (1,))
        leaf = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
        target = distribute_tensor(labels, mesh, [Replicate()])
        with LossBytes() as fwd:
            loss = fn(leaf, target)
        with LossBytes() as bwd, loss_parallel_context():
            loss.backward()
        return dict(fwd.by_op), dict(bwd.by_op)
    leaf = logits.clone().requires_grad_()
    with LossBytes() as fwd:
        loss = fn(leaf, labels)
    with LossBytes() as bwd:
        loss.backward()
    return dict(fwd.by_op), dict(bwd.by_op)


def bytes_per_logit(kind: str) -> tuple[float, float]:
    """Forward and backward bytes per logit of ``kind``: the difference between
    :data:`VOCABS`' counts over the logits' difference."""
    (f1, b1), (f2, b2) = (measure(kind, v) for v in VOCABS)
    logits = TOKENS * (VOCABS[1] - VOCABS[0])
    return (sum(f2.values()) - sum(f1.values())) / logits, (
        sum(b2.values()) - sum(b1.values())
    ) / logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--verbose", action="store_true", help="each op's bytes per logit")
    parser.add_argument("--json", action="store_true", help="print {loss: [fwd, bwd]} only")
    args = parser.parse_args()
    out: dict[str, list[float]] = {}
    for kind in LOSSES:
        fwd, bwd = bytes_per_logit(kind)
        out[kind] = [fwd, bwd]
        if args.json:
            continue
        print(f"{kind:20s} forward {fwd:5.2f}  backward {bwd:5.2f}  B/logit")
        if args.verbose:
            (f1, b1), (f2, b2) = (measure(kind, v) for v in VOCABS)
            logits = TOKENS * (VOCABS[1] - VOCABS[0])
            for name, a, b in (("forward", f1, f2), ("backward", b1, b2)):
                per = {op: round((b[op] - a.get(op, 0)) / logits, 3) for op in b}
                print(f"    {name}: {per}")
    if args.json:
        print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
