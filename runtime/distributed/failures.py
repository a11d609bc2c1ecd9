"""How a rank names a failure: a peer gone or silent (:class:`PipelineRankError`), and the
one-line gist of a backend error. Shared by the start-up agreement (``agree.py``), the
pipeline (``pipeline.py``) and ``autopipe run``'s checkpoint save."""

from __future__ import annotations

import re

import torch.distributed as dist

from autopipe.core.errors import Failure

__all__ = ["PipelineRankError", "is_comm_failure", "one_line", "short_cause"]


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
