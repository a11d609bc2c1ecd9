"""The memory of torchtitan's loss, measured: ``cross_entropy(pred.flatten(0, 1).float(),
labels)`` on bf16 logits, plain and under torch's ``loss_parallel()`` (the DTensor handlers of
``torch/distributed/tensor/parallel/loss.py``, which torchtitan runs whenever TP is on), in
bytes per logit at the forward's and the backward's peaks:

    .venv/bin/python benchmarks/loss_memory.py [--tokens 4096] [--vocab 16384]

On the CPU, one process (a gloo world of 1, the logits ``Shard(-1)`` over a mesh of 1: the
same handlers a TP rank runs on its ``V / T`` shard). The peak is the process's peak resident
set (``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs``) above what was resident when
the pass began: glibc maps tensors this large with ``mmap``, so the resident set follows the
live tensors, and the sequence of allocations is the one the CUDA caching allocator sees.
Linux only. The figures are what ``published_runs._LOSS_PEAK_BYTES`` prices (docs/
cost-model.md, "torch's loss parallel peaks at four fp32 copies of the logits"): plain
forward 2 + 8, backward 4 (saved log-softmax) + 8; loss parallel forward 2 + 12, backward 4 +
12.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel


def _resident(field: str) -> int:
    """``field`` (VmRSS, VmHWM) of /proc/self/status in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(tokens: int, vocab: int, parallel: bool, seed: int = 0) -> tuple[float, float, float]:
    """Bytes per logit of ``tokens x vocab`` bf16 logits: the forward's peak above the start
    (the bf16 logits not included), what is live when the backward begins (the logits freed,
    ``del pred`` as torchtitan's train step does) and the backward's peak above that."""
    torch.manual_seed(seed)
    n = tokens * vocab
    labels = torch.randint(0, vocab, (1, tokens))
    x = torch.randn(1, tokens, 64, dtype=torch.bfloat16)
    w = torch.randn(vocab, 64, dtype=torch.bfloat16, requires_grad=True)
    pred = x @ w.t()
    if parallel:
        mesh = init_device_mesh("cpu", (1,))
        pred = DTensor.from_local(pred, mesh, [Shard(-1)])
    gc.collect()
    with loss_parallel() if parallel else contextlib.nullcontext():
        start = _resident("VmRSS")
        _reset_peak()
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
        forward = _resident("VmHWM") - start
        del pred
        gc.collect()
        begin = _resident("VmRSS")
        _reset_peak()
        loss.backward()
        backward = _resident("VmHWM") - begin
    return forward / n, (begin - start) / n + 2.0, backward / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=16384)
    args = ap.parse_args(argv)
    if not os.path.exists("/proc/self/clear_refs"):
        print("needs Linux's /proc/self/clear_refs", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        for parallel in (False, True):
            fwd, live, bwd = measure(args.tokens, args.vocab, parallel)
            name = "loss_parallel()" if parallel else "plain         "
            print(
                f"{name} forward peak 2 + {fwd:5.2f} B/logit (bf16 logits + the loss's); "
                f"backward {live:5.2f} live (saved log-softmax) + {bwd:5.2f} = "
                f"{live + bwd:5.2f} B/logit"
            )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
