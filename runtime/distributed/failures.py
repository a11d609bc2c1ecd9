"""How a rank names a failure: a peer gone or silent (:class:`PipelineRankError`), and the
one-line gist of a backend error. Shared by the start-up agreement (``agree.py``), the
pipeline (``pipeline.py``) and ``autopipe run``'s checkpoint save.

The root cause travels to the peers: a rank whose own step fails writes its one-line error
to the process group's c10d store (the one the ranks met on at rendezvous: torchrun's agent
holds it, or rank 0 without an agent) before it raises, the first such line winning
(:func:`publish_failure`); a peer that then finds the pipeline broken (a closed connection,
a timeout) or is stopped by torchrun reads it (:func:`published_failure`) and names it in
its own line, instead of only "a peer rank failed".

``autopipe run`` holds one board for the whole run (:func:`run_board`), so that a failure
in its start-up (tracing, splitting, the mesh, TP and FSDP, the plan agreement, the
weights, the optimizer) reaches the peers as a step's does, whichever phase each peer is
in. When the store cannot be reached its host is gone: without torchrun's agent that is
rank 0 (:func:`failure_cause` then says so, since no line can be read)."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist

from autopipe.core.errors import Failure

__all__ = [
    "PipelineRankError",
    "board_reader",
    "failure_board",
    "failure_cause",
    "is_comm_failure",
    "on_every_rank",
    "one_line",
    "publish_failure",
    "raised_on_every_rank",
    "published_failure",
    "run_board",
    "store_host_gone",
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


_EVERY_RANK = "_autopipe_on_every_rank"

E = TypeVar("E", bound=BaseException)


def on_every_rank(exc: E) -> E:
    """Mark ``exc`` as an error every rank raises alike, having found it together (the plan
    agreement, a barrier): no peer needs it from the store, and none should write it there,
    since rank 0, the store's host without torchrun's agent, may already be exiting with its
    own copy (c10d's client then prints C++ frames). Returns ``exc``."""
    setattr(exc, _EVERY_RANK, True)
    return exc


def raised_on_every_rank(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, is marked by :func:`on_every_rank`."""
    seen: BaseException | None = exc
    while seen is not None:
        if getattr(seen, _EVERY_RANK, False):
            return True
        seen = seen.__cause__
    return False


PUBLISHED_WAIT_S = 1.0
"""How long a rank that found the pipeline broken waits for the failing rank's line to reach
the store (it is written before that rank raises, so before its connections close; the wait
covers a peer that noticed first, e.g. by its own timeout)."""

_boards = itertools.count()
_board: str | None = None
_held = False
"""Whether a :func:`run_board` is open: a pipeline built inside it keeps the run's board."""


def failure_board() -> str:
    """A fresh store key for the failures of one pipeline (each rank builds its pipelines in
    the same order, so the n-th pipeline's key is the same on every rank, and a failure of
    an earlier pipeline in the same process group is never read as this one's); the key
    :func:`publish_failure` and :func:`published_failure` use until the next call. Inside
    :func:`run_board` it is the run's key, unchanged: a rank that fails before its pipeline
    exists and a peer already inside it must meet on the same key."""
    global _board
    if _held and _board is not None:
        return _board
    _board = f"autopipe/failure/{next(_boards)}"
    return _board


@contextlib.contextmanager
def run_board() -> Iterator[str]:
    """One failure board (store key) for a whole run, from just after the process group is
    joined through the last step: the start-up's failures and the steps' go to the same key,
    which every pipeline built meanwhile keeps (:func:`failure_board`). Yields the key."""
    global _held
    _held = False
    key = failure_board()
    _held = True
    try:
        yield key
    finally:
        _held = False


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
        if store is not None and not _store_gone(store):
            store.compare_set(_board, "", line)
    except Exception:  # noqa: BLE001 - the store's host is gone: the peers cannot read it anyway
        return


def published_failure(wait_s: float = 0.0) -> str | None:
    """The line a failing rank published (:func:`publish_failure`), waiting up to ``wait_s``
    seconds for one to appear; None if none did or the store cannot be reached (its host,
    rank 0 launched without torchrun's agent, may be the rank that failed)."""
    line, _ = _read_board(wait_s)
    return line


def _store_gone(store: Any) -> bool:
    """Whether the TCP store under ``store`` (a c10d ``PrefixStore`` chain) no longer
    accepts connections: its host has exited. Asked before any store call, because c10d's
    client logs a C++ stack trace on stderr for each call to a store that is gone. A store
    that is not a TCP store, or that accepts, is taken as alive."""
    while isinstance(getattr(store, "underlying_store", None), dist.Store):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if not isinstance(host, str) or not isinstance(port, int):
        return False
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return False
    except OSError:
        return True


def _read_board(wait_s: float) -> tuple[str | None, bool]:
    """(the published line or None, whether the store answered)."""
    if _board is None:
        return None, True
    deadline = time.monotonic() + wait_s
    try:
        store = _store()
        if store is None:
            return None, True
        # Probed before each call: the host may be exiting while this rank reads (a
        # failing rank 0 without torchrun's agent), and each call to a store that is gone
        # prints c10d's C++ frames. The window left is between a probe and its call.
        while True:
            if _store_gone(store):
                return None, False
            if store.check([_board]):
                break
            if time.monotonic() >= deadline:
                return None, True
            time.sleep(0.05)
        if _store_gone(store):
            return None, False
        value: bytes = store.get(_board)
    except Exception:  # noqa: BLE001 - no store to read: its host is gone
        return None, False
    return value.decode(errors="replace") or None, True


def store_host_gone() -> str:
    """The line a rank gives for the cause when the store cannot be reached: who held it.
    torchrun's agent holds it when it sets ``TORCHELASTIC_USE_AGENT_STORE``; otherwise rank
    0 does (c10d's ``env://`` rendezvous), and the failing rank was rank 0 itself."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return "the c10d store (held by torchrun's agent) cannot be reached to read the cause"
    return (
        "rank 0 is gone, and with it the c10d store it held, so its cause cannot be read "
        "here: rank 0's own error line (and the launcher's report) names it"
    )


def board_reader() -> Callable[[], str | None] | None:
    """A reader of the current board for another thread: a call returns the published line
    or None (none yet, or the store's host gone), without waiting. It reads on a connection
    of its own (``Store.clone``): c10d's client serializes its calls, so reading through
    the default group's store would wait as long as the main thread waits on it (a new
    group's rendezvous: the whole timeout). None without a process group or board."""
    store = _store() if _board is not None else None
    if store is None:
        return None
    key = _board
    try:
        own = store.clone()
    except Exception:  # noqa: BLE001 - a store that cannot be cloned: nothing to read with
        return None

    def read() -> str | None:
        try:
            if _store_gone(own) or not own.check([key]):
                return None
            value: bytes = own.get(key)
        except Exception:  # noqa: BLE001 - gone meanwhile: nothing to read
            return None
        return value.decode(errors="replace") or None

    return read


def failure_cause(wait_s: float = 0.0) -> str | None:
    """The root cause a peer's error line should carry: the line a failing rank published
    (:func:`publish_failure`, waiting up to ``wait_s`` seconds for one); when the store
    cannot be reached, :func:`store_host_gone`; None when no rank published one (a peer
    that hangs, or one killed before it could write)."""
    line, answered = _read_board(wait_s)
    if line is None and not answered:
        return store_host_gone()
    return line
