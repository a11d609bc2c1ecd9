"""Profile cache: measured profiles saved as JSON and reused for the same problem.

A profile is reused when the model structure (module tree and parameter shapes/dtypes),
the model's code (the bytes of every file defining one of its module classes, and each
class's ``forward`` bytecode), the input shapes/dtypes, the device, dtype, granularity, measurement options, the
autopipe version and the profile's unit fields are all the same: they form the key, a SHA-256 hash. Files live in
``$AUTOPIPE_CACHE_DIR`` or ``~/.cache/autopipe``, one ``<key>.json`` each. A corrupt, foreign
or outdated file is reported with a warning and ignored (the caller re-measures).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import types
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from autopipe.profiler.tree import leaves
from torch import nn

import autopipe
from autopipe.core.profile import Profile, ProfileFormatError, UnitProfile


def autopipe_version() -> str:
    return str(autopipe.__version__)


def unit_fields() -> list[str]:
    """The names of :class:`UnitProfile`'s fields: part of the cache key."""
    return [f.name for f in dataclasses.fields(UnitProfile)]


def default_cache_dir() -> Path:
    """``$AUTOPIPE_CACHE_DIR`` if set, else ``~/.cache/autopipe``."""
    env = os.environ.get("AUTOPIPE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "autopipe"


def _describe_value(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ["tensor", list(x.shape), str(x.dtype)]
    if isinstance(x, (int, float, bool, str, type(None))):
        return x
    return type(x).__qualname__


def _sha256_of_file(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _code_digest(code: types.CodeType) -> str:
    """SHA-256 of a code object's bytecode, names and constants (nested code included)."""
    h = hashlib.sha256(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        h.update(
            _code_digest(const).encode()
            if isinstance(const, types.CodeType)
            else repr(const).encode()
        )
    return h.hexdigest()


def code_signature(model: nn.Module) -> dict[str, Any]:
    """What identifies the code a model runs: for every class among its modules, the
    SHA-256 of the file defining it (module-level helpers its ``forward`` calls live there
    too) and of its ``forward``'s bytecode (which also covers classes without a file, e.g.
    defined by ``exec``). Editing ``forward`` changes it; weights do not."""
    classes = sorted(
        {type(m) for m in model.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}"
    )
    files: dict[str, str | None] = {}
    out: dict[str, Any] = {}
    for cls in classes:
        try:
            path = inspect.getsourcefile(cls)
        except (TypeError, OSError):
            path = None
        if path is not None and path not in files:
            files[path] = _sha256_of_file(path)
        forward = getattr(cls, "forward", None)
        code = getattr(forward, "__code__", None)
        out[f"{cls.__module__}.{cls.__qualname__}"] = {
            "file": files.get(path) if path else None,
            "forward": _code_digest(code) if isinstance(code, types.CodeType) else None,
        }
    return out


def model_signature(model: nn.Module) -> dict[str, Any]:
    """What identifies a model's structure and code: the module tree, every parameter/buffer's
    name, shape and dtype (values are not hashed: profiles do not depend on them) and
    :func:`code_signature`."""
    return {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "repr": repr(model),
        "code": code_signature(model),
        "parameters": [
            [n, list(p.shape), str(p.dtype), p.requires_grad]
            for n, p in model.named_parameters(remove_duplicate=False)
        ],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in model.named_buffers()],
    }


def inputs_signature(example_inputs: Any) -> dict[str, Any]:
    """Structure and tensor shapes/dtypes of the example inputs."""
    _, spec = pytree.tree_flatten(example_inputs)
    return {"spec": str(spec), "leaves": [_describe_value(x) for x in leaves(example_inputs)]}


def cache_key(model: nn.Module, example_inputs: Any, **options: Any) -> str:
    """SHA-256 over model and input signatures, the autopipe version and ``options``
    (device, dtype, granularity, ...: anything that changes the measured profile)."""
    payload = {
        "model": model_signature(model),
        "inputs": inputs_signature(example_inputs),
        "autopipe_version": autopipe_version(),
        "torch_version": torch.__version__,
        # a field the profiler learns to record (between releases too) is not in an older
        # file: its default would pass for a measurement
        "unit_fields": unit_fields(),
        "options": {k: str(v) for k, v in sorted(options.items())},
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def cache_path(key: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the profile for ``key`` lives: ``<cache_dir or default_cache_dir()>/<key>.json``."""
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return root / f"{key}.json"


def load_cached(key: str, cache_dir: str | os.PathLike[str] | None = None) -> Profile | None:
    """The cached profile for ``key``, or None when absent. A file that cannot be used
    (corrupt JSON, unknown schema version, other autopipe version) gives a warning and None."""
    path = cache_path(key, cache_dir)
    if not path.exists():
        return None
    try:
        profile = Profile.load(path)
    except (ProfileFormatError, OSError, UnicodeDecodeError, ValueError, TypeError) as exc:
        # A well-formed entry with a bad value (a negative time, say) is as unusable as a
        # corrupt one: name it and measure again rather than fail every later run.
        detail = str(exc).removeprefix(f"{path}: ")
        warnings.warn(
            f"ignoring unusable cached profile {path}: {detail}; re-measuring", stacklevel=2
        )
        return None
    if profile.autopipe_version != autopipe_version():
        warnings.warn(
            f"ignoring cached profile {path} from autopipe {profile.autopipe_version!r} "
            f"(this is {autopipe_version()}); re-measuring",
            stacklevel=2,
        )
        return None
    return profile


def save_cached(
    profile: Profile, key: str, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Write ``profile`` under ``key`` (atomically); a write failure only warns."""
    path = cache_path(key, cache_dir)
    try:
        profile.save(path)
    except OSError as exc:
        warnings.warn(f"could not write profile cache {path}: {exc}", stacklevel=2)
    return path
