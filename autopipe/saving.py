"""Saving the trained weights of a distributed run: one torch.distributed.checkpoint folder,
written all or nothing.

Every rank writes its stage's weights, under the model's own parameter names, into a fresh
sibling of the target folder; rank 0 renames it to the target once every rank has written.
A rank that dies or hangs mid-save leaves the earlier checkpoint whole (or none), never a mix
of old and new files. :func:`save_dir_problem` says before any work why a folder cannot be
replaced. torch is imported by :func:`save_checkpoint` only, so the CLI can check ``--save``
without it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from autopipe.core.datafile import created_mode
from autopipe.core.errors import Failure
from autopipe.outputs import output_path_problem

if TYPE_CHECKING:
    from autopipe.runtime.distributed.pipeline import DistributedPipeline

__all__ = ["save_checkpoint", "save_dir_problem"]

_CHECKPOINT_ENTRY = re.compile(r"(__\d+)?\.metadata(\.tmp)?|__\d+_\d+\.distcp")
"""The names torch.distributed.checkpoint's FileSystemWriter gives the entries of a
checkpoint folder."""


def save_dir_problem(path: str) -> str | None:
    """Why the checkpoint folder ``path`` (``--save DIR``) cannot be written or replaced, as
    one line, or None.

    The checkpoint is written into a fresh sibling of ``path`` and renamed to it at the end
    (:func:`save_checkpoint`), so ``path`` must name a directory entry (not ``''``, ``.``,
    ``..``) that is absent or a folder of this user's holding nothing but checkpoint files,
    and the folder above must take new entries (tried:
    :func:`autopipe.outputs.output_path_problem`)."""
    if not path.strip():
        return "--save needs a directory name, got ''"
    target = Path(path)
    if target.name in ("", ".", ".."):
        return (
            f"--save {path}: name the directory to create or replace (the checkpoint is written "
            "beside it and renamed to it), not the current or a parent folder"
        )
    problem = _replace_problem(target)
    if problem is not None:
        return f"--save {path}: {problem}"
    return output_path_problem(str(target.parent), "--save", directory=True)


def _replace_problem(target: Path) -> str | None:
    """Why ``target`` must not be replaced by a new checkpoint, or None (``target`` is
    absent, or a folder of nothing but checkpoint files, which the swap deletes)."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot look at it ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return (
            "is a symbolic link; give the directory itself (a link is never followed: "
            "someone else may have planted it)"
        )
    if not stat.S_ISDIR(st.st_mode):
        return "is a file; give a directory"
    if st.st_uid != os.geteuid():
        return (
            f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): it cannot be "
            "replaced safely; give a directory of your own or a new name"
        )
    try:
        foreign = sorted(e for e in os.listdir(target) if not _CHECKPOINT_ENTRY.fullmatch(e))
    except OSError as exc:
        return f"cannot list it ({exc.strerror or exc})"
    if foreign:
        return (
            f"holds {foreign[0]!r}, no part of a checkpoint, and the new checkpoint replaces "
            "the whole folder: give a new or empty directory, or an earlier --save DIR"
        )
    return None


def save_checkpoint(pipe: DistributedPipeline, directory: str) -> None:
    """Every rank's stage weights, under the model's own names, as one distributed checkpoint
    in ``directory`` (replicated entries, e.g. data-parallel copies, are written once).
    Collective: call on every rank.

    All or nothing: rank 0 creates a fresh sibling folder (``mkdtemp``: a new random name,
    mode 0700), every rank writes its part there, and after a barrier rank 0 renames it to
    ``directory`` (an earlier checkpoint there is moved aside first and deleted after). A
    rank that dies or hangs mid-save leaves the earlier checkpoint whole (or none), never a
    mix of old and new files; the others end with :class:`Failure` within the process-group
    timeout. Needs a folder every rank sees (as torch.distributed.checkpoint does)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from autopipe.runtime.distributed.failures import short_cause

    target = Path(directory)
    rank = dist.get_rank()
    staging: Path | None = None
    message: list[str | None] = [None, None]  # [staging folder name, error]
    if rank == 0:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.saving-"))
            message[0] = staging.name
        except OSError as exc:
            message[1] = f"--save {directory}: cannot create a folder beside it ({exc})"
    try:
        dist.broadcast_object_list(message, src=0)
        if message[1] is not None:
            raise Failure(message[1])
        assert message[0] is not None
        staging = target.parent / message[0]
        dcp.save(pipe.state_dict(), checkpoint_id=staging)
        dist.barrier()  # every rank has written its part
    except Failure:
        raise
    except Exception as exc:
        left = ""
        if rank == 0 and staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        elif staging is not None:  # rank 0 deletes it, unless rank 0 was lost too
            left = (
                f" (its unfinished copy {staging} is deleted by rank 0; if rank 0 died, delete it)"
            )
        raise Failure(
            f"the checkpoint was not saved ({short_cause(exc)}); {directory} is as it was{left}"
        ) from exc
    outcome: list[str | None] = [_swap_in(staging, target) if rank == 0 else None]
    try:
        dist.broadcast_object_list(outcome, src=0)
    except Exception as exc:
        raise Failure(
            f"rank 0 did not say whether it moved the checkpoint to {directory} "
            f"({short_cause(exc)})"
        ) from exc
    if outcome[0] is not None:
        raise Failure(outcome[0])


def _swap_in(staging: Path, target: Path) -> str | None:
    """Rename the complete checkpoint ``staging`` to ``target`` (rank 0, after every rank
    has written); an earlier ``target`` is first moved into a fresh folder of its own and
    deleted after the swap. Returns None, or the one-line error (``staging`` then stays)."""
    problem = _replace_problem(target)  # again: the folder may have changed since start-up
    if problem is not None:
        return f"--save {target}: {problem}; the new checkpoint is in {staging}"
    aside: Path | None = None
    try:
        os.chmod(staging, created_mode(0o777))  # what a plain mkdir would have given
        if os.path.lexists(target):
            aside = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
            os.rename(target, aside / "checkpoint")
        os.rename(staging, target)
    except OSError as exc:
        if aside is not None and not os.path.lexists(target):
            with contextlib.suppress(OSError):
                os.rename(aside / "checkpoint", target)
        return (
            f"could not move the new checkpoint to {target} ({exc.strerror or exc}); "
            f"it is in {staging}"
        )
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return None
