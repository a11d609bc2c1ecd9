"""Where a command or an API call may write its output: the checks made before any work.

:func:`output_path_problem` says in one line why a path cannot be written (it names an input
the call reads, a directory where a file is expected, a folder that takes no new file, ...),
so that the CLI (``cli/common.py:check_output_path``, naming the flag) and the Python API
(:func:`autopipe.train`, :func:`autopipe.bench_model_file`, :func:`autopipe.plot_plan`, naming
the field) refuse it alike, before a process group is joined or a step is run.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from autopipe.core.datafile import is_named_pipe
from autopipe.core.errors import UsageError

__all__ = ["check_output", "inside_folder_problem", "output_path_problem"]


def output_path_problem(
    path: str | Path,
    label: str,
    *,
    directory: bool = False,
    inputs: Sequence[str | Path | None] = (),
) -> str | None:
    """Why ``path`` cannot be written, as one line starting with ``label`` (the flag or field
    that gave it), or None.

    ``directory``: ``path`` is a folder to write into; otherwise a file. Either way the
    nearest existing folder must take a new file (tried, not guessed from permission bits:
    root, read-only mounts and ACLs all decide), and missing folders are created on write.
    ``inputs``: files the call reads (a ``MODEL.py:FACTORY`` spec counts as its file);
    writing over one of them would destroy it."""
    text = str(path)
    if text == "":  # Path("") is the current folder: never what an empty value meant
        return f"{label} is empty; give a path"
    out = Path(text)
    if out.exists() and out.is_dir() != directory:
        kind = "a file" if directory else "a directory"
        return f"{label} {text} is {kind}; give a {'directory' if directory else 'file'}"
    if not directory and out.exists():
        for given in inputs:
            source = _input_file(given)
            if source is not None and os.path.samefile(source, out):
                return (
                    f"{label} {text} is the input {given}; writing there would destroy it: "
                    "give another path"
                )
    if not directory and is_named_pipe(out):
        return (
            f"{label} {text} is a named pipe: writing it waits, forever if no process reads "
            "it; give a regular file (or - for stdout)"
        )
    if not directory and out.exists() and _is_stream(out):
        # /dev/null, /dev/stdout, a named pipe: written through, never replaced, so the
        # folder holding it needs no room for a new file.
        if not os.access(out, os.W_OK):
            return f"{label} {text}: cannot write to it (permission denied)"
        return None
    folder = out if directory and out.exists() else out.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        return f"{label} {text}: {folder} is a file, not a directory"
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".autopipe-write-check-")
    except OSError as exc:
        return f"{label} {text}: cannot write in {folder} ({exc.strerror or exc}); give a writable path"
    os.close(fd)
    os.unlink(probe)
    return None


def check_output(
    path: str | Path,
    label: str,
    *,
    directory: bool = False,
    inputs: Sequence[str | Path | None] = (),
) -> None:
    """Raise ``UsageError`` with :func:`output_path_problem`'s line, if there is one."""
    problem = output_path_problem(path, label, directory=directory, inputs=inputs)
    if problem is not None:
        raise UsageError(problem)


def inside_folder_problem(
    path: str | Path, label: str, folder: str | Path, folder_label: str
) -> str | None:
    """Why ``path`` cannot be written inside ``folder``, a checkpoint folder that holds
    only the checkpoint (its save swaps the whole folder in at the end, and refuses one
    that holds anything else): one line naming both, or None. O(path depth)."""
    inner, outer = Path(path).resolve(), Path(folder).resolve()
    if inner == outer or outer in inner.parents:
        return (
            f"{label} {path} is inside {folder_label} {folder}, which holds only the "
            "checkpoint; write it elsewhere"
        )
    return None


def _is_stream(path: Path) -> bool:
    """Whether ``path`` is (or links to) a character device or a FIFO."""
    mode = path.stat().st_mode
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def _input_file(given: str | Path | None) -> Path | None:
    """The file behind an input argument (``MODEL.py[:FACTORY]`` or a path), if it exists."""
    if not given:
        return None
    text = str(given)
    for candidate in (text, text.rpartition(":")[0]):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None
