"""Re-materialization: run a stage with ``torch.utils.checkpoint`` (non-reentrant).

The forward keeps only the stage's inputs; backward recomputes the stage (GPipe's
re-materialization) with the RNG state of the original forward restored
(``preserve_rng_state=True``), so dropout masks are identical in the recomputation.
The recomputation must not have side effects: BatchNorm running statistics updated during
it are restored afterwards, and ``is_recomputing()`` lets modules (DeferredBatchNorm)
skip bookkeeping. The recomputation is reported to ``on_recompute`` so the timeline shows it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpointed", "is_recomputing", "recomputing"]

_STATE = threading.local()


def is_recomputing() -> bool:
    """True while this thread re-runs a checkpointed forward during backward."""
    return getattr(_STATE, "depth", 0) > 0


@contextmanager
def recomputing() -> Iterator[None]:
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


@contextmanager
def _restore_batchnorm_stats(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Put BatchNorm buffers back as they were: a recomputation must not update them twice."""
    saved = [
        (buf, buf.detach().clone())
        for m in modules
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        for buf in m.buffers(recurse=False)
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)


def checkpointed(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    modules: Sequence[nn.Module] = (),
    on_recompute: Callable[[], AbstractContextManager[None]] | None = None,
) -> Any:
    """``fn(*inputs)`` whose activations are recomputed in backward instead of stored.

    ``modules`` are the stage's modules (for the BatchNorm restore); ``on_recompute`` returns
    a context manager entered around each recomputation (e.g. a timeline record).
    Cost: one extra forward of ``fn`` during backward; memory: only ``inputs`` are kept.
    """
    calls = 0

    def run(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*args)
        timing = on_recompute() if on_recompute is not None else nullcontext()
        with timing, recomputing(), _restore_batchnorm_stats(modules):
            return fn(*args)

    return checkpoint(run, *inputs, use_reentrant=False, preserve_rng_state=True)
