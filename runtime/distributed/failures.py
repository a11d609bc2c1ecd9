"""How a rank names a failure: a peer gone or silent (:class:`PipelineRankError`), and the
one-line gist of a backend error. Shared by the start-up agreement (``agree.py``), the
pipeline (``pipeline.py``) and ``autopipe run``'s checkpoint save.

The root cause travels to the peers: a rank whose own step fails writes its one-line error
to the process group's c10d store (the one the ranks met on at rendezvous: torchrun's agent
holds it, or rank 0 without an agent) before it raises, the first such line winning
(:func:`publish_failure`); a peer that then finds the pipeline broken (a closed connection,
a timeout) or is stopped by torchrun reads it (:func:`published_failure`) and names it in
its own line, instead of only "a peer rank failed"."""

from __future__ import annotations

import itertools
import re
import time
from typing import Any

import torch.distributed as dist

from autopipe.core.errors import Failure

__all__ = [
    "PipelineRankError",
    "failure_board",
    "is_comm_failure",
    "one_line",
    "publish_failure",
    "published_failure",
    "short_cause",
]


class PipelineRankError(Failure, RuntimeError):
    """A peer rank failed or stopped answering: this rank cannot continue."""


def short_cause(exc: BaseException) -> str:
    """The gist of a backend error: first line, without gloo's source location and advice."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". This is typically")[0]


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``, as ranks compare and report an error."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def is_comm_failure(exc: BaseException) -> bool:
    """Errors that mean a peer is gone or silent rather than a bug in this rank's compute."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return any(
        key in text
        for key in ("connection closed", "connection reset", "timed out", "timeout", "broken pipe")
    )


PUBLISHED_WAIT_S = 1.0
"""How long a rank that found the pipeline broken waits for the failing rank's line to reach
the store (it is written before that rank raises, so before its connections close; the wait
covers a peer that noticed first, e.g. by its own timeout)."""

_boards = itertools.count()
_board: str | None = None


def failure_board() -> str:
    """A fresh store key for the failures of one pipeline (each rank builds its pipelines in
    the same order, so the n-th pipeline's key is the same on every rank, and a failure of
    an earlier pipeline in the same process group is never read as this one's); the key
    :func:`publish_failure` and :func:`published_failure` use until the next call."""
    global _board
    _board = f"autopipe/failure/{next(_boards)}"
    return _board


def _store() -> Any:
    """The default process group's c10d store, or None (no group)."""
    if not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


def publish_failure(line: str) -> None:
    """Write ``line`` (this rank's own error, one line naming the rank) as the pipeline's
    root cause, unless a rank wrote one first (``compare_set`` keeps the first). Best
    effort: a store that cannot be reached changes nothing about this rank's own error."""
    if _board is None:
        return
    try:
        store = _store()
        if store is not None:
            store.compare_set(_board, "", line)
    except Exception:  # noqa: BLE001 - the store's host is gone: the peers cannot read it anyway
        return


def published_failure(wait_s: float = 0.0) -> str | None:
    """The line a failing rank published (:func:`publish_failure`), waiting up to ``wait_s``
    seconds for one to appear; None if none did or the store cannot be reached (its host,
    rank 0 launched without torchrun's agent, may be the rank that failed)."""
    if _board is None:
        return None
    deadline = time.monotonic() + wait_s
    try:
        store = _store()
        if store is None:
            return None
        while not store.check([_board]):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        value: bytes = store.get(_board)
    except Exception:  # noqa: BLE001 - no store to read: the caller says "a peer failed"
        return None
    return value.decode(errors="replace") or None
