"""Versioned JSON files, written and read one way: atomically, and with one-line errors.

Torch-free and imports nothing of autopipe's layers, so the profiler (Profile), the planner
(Plan) and the tools (traces, reports) share it without pointing at each other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "atomic_write_json",
    "atomic_write_text",
    "check_version",
    "created_mode",
    "is_named_pipe",
    "known_fields",
    "load_json_file",
    "not_a_regular_file",
    "read_json",
    "strict_json",
]

T = TypeVar("T")

# mkstemp creates files 0600; a profile or plan is no secret, so it gets the mode open()
# would give it. The umask can only be read by setting it: do it once, at import.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def created_mode(mode: int) -> int:
    """The permission bits ``mode`` gives a new file or folder under this process's umask
    (``0o777`` for a folder, ``0o666`` for a file, as ``mkdir`` and ``open`` would)."""
    return mode & ~_UMASK


def strict_json(obj: Any) -> Any:
    """``obj`` with NaN and infinities as null: bare ``NaN`` is not JSON (jq, JavaScript and
    most parsers reject it)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def atomic_write_json(path: str | os.PathLike[str], data: Any, *, strict: bool = False) -> None:
    """Write ``data`` as JSON to ``path`` so that readers see the old file or the whole new one.

    The text goes to a temp file created exclusively (``O_EXCL``, a fresh random name: a
    planted symlink cannot redirect it, concurrent writers cannot collide) in the target's
    directory, then replaces ``path``; on any failure the temp file is removed. ``strict``:
    refuse NaN and infinities (``ValueError``), which are not JSON.
    """
    text = json.dumps(data, indent=2, allow_nan=not strict) + "\n"  # fails before any file
    atomic_write_text(path, text)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` atomically, as :func:`atomic_write_json` does.

    What ``path`` names decides how: a regular file (or none) is replaced atomically; a
    symbolic link keeps being one: the file it points at is replaced; a character device or
    FIFO (``/dev/null``, ``/dev/stdout``, a named pipe), or a link to one, is opened and
    written to, never replaced. Any other kind (a block device, a socket) is an ``OSError``.
    """
    path = Path(path)
    try:
        st = os.stat(path)  # follows links: what a write would reach
    except FileNotFoundError:
        st = None
    if st is not None and (stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
        _write_through(path, text)
        return
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise OSError(
            errno.EINVAL, f"{path} is neither a regular file, a character device nor a FIFO"
        )
    if path.is_symlink():
        path = Path(os.path.realpath(path))  # replace the file the link points at
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), created_mode(0o666))
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def not_a_regular_file(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is when it exists but is no regular file to read (``"a directory"``,
    ``"a named pipe"``, ``"not a regular file"``), for an input's error to say instead of
    "not found"; None when it is a regular file or does not exist."""
    p = Path(path)
    if not p.exists() or p.is_file():
        return None
    if p.is_dir():
        return "a directory"
    return "a named pipe" if is_named_pipe(p) else "not a regular file"


def is_named_pipe(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is (or links to) a FIFO made on a file system (``mkfifo``): opening
    it blocks until another process opens its other end, forever if none does. The pipes
    of the shell's own streams (``/dev/stdout`` piped on, ``/dev/fd/63`` from ``<(...)``)
    are under ``/dev`` or ``/proc`` and are not named pipes here."""
    try:
        if not stat.S_ISFIFO(os.stat(path).st_mode):
            return False
    except OSError:
        return False
    text = os.path.abspath(path)
    return not text.startswith(("/dev/", "/proc/"))


def _write_through(path: Path, text: str) -> None:
    """``text`` written into the character device or FIFO ``path`` (opened, never created or
    replaced; a FIFO waits for its reader)."""
    fd = os.open(path, os.O_WRONLY | os.O_NOCTTY)
    with os.fdopen(fd, "wb") as f:
        f.write(text.encode("utf-8"))


def read_json(path: str | os.PathLike[str], error: type[Exception]) -> Any:
    """The JSON value in ``path``; ``error`` (one line naming the file) for a file that is
    not UTF-8 text or not JSON. OS errors (missing, unreadable) propagate."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise error(f"{path}: not a JSON text file (not UTF-8)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:  # e.g. [[[[...]]]] 200k deep: no autopipe file nests like that
        raise error(f"{path}: JSON nested too deeply to read") from None


def check_version(
    data: Any, key: str, version: int, kind: str, error: type[Exception], remake: str
) -> None:
    """``error`` unless ``data`` is an object with ``key`` and schema ``version``: a file of
    another kind or another schema says what it is not and how to make a good one."""
    if not isinstance(data, dict) or key not in data:
        raise error(f"not an autopipe {kind}: no {key!r} key")
    if data.get("version") != version:
        raise error(
            f"{kind} schema version {data.get('version')!r} is not supported (expected "
            f"{version}); {remake}"
        )


def load_json_file(
    path: str | os.PathLike[str], parse: Callable[[Any], T], error: type[Exception]
) -> T:
    """``parse(read_json(path))``, with the file's name put in front of ``parse``'s
    ``error``."""
    data = read_json(path, error)
    try:
        return parse(data)
    except error as exc:
        raise error(f"{path}: {exc}") from exc


def known_fields(cls: type, data: Any, *, without: tuple[str, ...] = ()) -> dict[str, Any]:
    """The items of the JSON object ``data`` that are fields of the dataclass ``cls`` (but not
    ``without``): keys a newer writer added are left out, so files stay readable across
    additive schema changes. O(len(data))."""
    names = {f.name for f in dataclasses.fields(cls)} - set(without)
    return {k: v for k, v in data.items() if k in names}
