"""Load a user's model file: ``MODEL.py[:FACTORY]``.

The file defines ``build_model()`` (or the named FACTORY) returning an ``nn.Module`` and
``example_inputs(batch_size)`` returning a tensor, a tuple of positional tensors or a dict
of keyword tensors. For a named factory, ``example_inputs_FACTORY(batch_size)`` is used
when the file defines it. An optional ``loss_fn(output, inputs)`` drives backward: it is
called on one micro-batch (its output and its rows of the inputs) and returns the mean over
those rows or ``(sum, count)`` (:mod:`autopipe.profiler.objective`). An optional
``tp_plan()`` returns the model's tensor-parallel plan (module path pattern -> ``colwise`` /
``rowwise``, as Hugging Face's ``base_model_tp_plan``), for models that carry none.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from autopipe.core.datafile import not_a_regular_file
from autopipe.core.errors import UsageError


class ModelFileError(UsageError, ValueError):
    """The model file or factory given on the command line cannot be used."""


@dataclass
class ModelFile:
    path: Path
    factory_name: str
    factory: Callable[[], Any]
    example_inputs: Callable[..., Any]
    loss_fn: Callable[[Any, Any], Any] | None
    module: ModuleType

    @property
    def label(self) -> str:
        return f"{self.path.name}:{self.factory_name}"

    @property
    def tp_plan(self) -> Callable[[], Any] | None:
        """The file's ``tp_plan()`` function (module path pattern -> ``colwise`` /
        ``rowwise``, as Hugging Face's ``base_model_tp_plan``), or None."""
        found = getattr(self.module, "tp_plan", None)
        return found if callable(found) else None

    def default_batch_size(self) -> int | None:
        """The ``batch_size`` default of ``example_inputs``, if it declares one."""
        try:
            params = list(inspect.signature(self.example_inputs).parameters.values())
        except (TypeError, ValueError):
            return None
        if params and isinstance(params[0].default, int):
            return params[0].default
        return None

    def build(self, device: str | None = None) -> Any:
        """Call the factory (under ``torch.device(device)`` when given, e.g. "meta")."""
        import torch
        from torch import nn

        try:
            if device is None:
                model = self.factory()
            else:
                with torch.device(device):
                    model = self.factory()
        except SystemExit as exc:
            raise ModelFileError(f"{self.label}: the factory {_exit_text(exc)}") from exc
        except Exception as exc:  # the user's code: report, don't crash
            raise ModelFileError(
                f"{self.label}: the factory raised {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(model, nn.Module):
            raise ModelFileError(
                f"{self.label}: the factory returned {type(model).__name__}, not a torch.nn.Module"
            )
        return model

    def inputs(self, batch_size: int | None) -> Any:
        """``example_inputs(batch_size)`` (its default when None). The batch (dim 0 of the
        first tensor with a dimension, as the profiler and runtimes read it) must have
        ``batch_size`` rows: a file that ignores the argument would otherwise be planned and
        trained at another batch size than the one reported."""
        call = f"{self.path.name}: {self.example_inputs.__name__}({batch_size or ''})"
        try:
            inputs = (
                self.example_inputs() if batch_size is None else self.example_inputs(batch_size)
            )
        except SystemExit as exc:
            raise ModelFileError(f"{call} {_exit_text(exc)}") from exc
        except Exception as exc:
            raise ModelFileError(f"{call} raised {type(exc).__name__}: {exc}") from exc
        rows = _batch_rows(inputs)
        if batch_size is not None and rows is not None and rows != batch_size:
            raise ModelFileError(
                f"{call} returned a batch of {rows} (dim 0), not {batch_size}; make "
                "example_inputs build batch_size samples"
            )
        return inputs


def _batch_rows(inputs: Any) -> int | None:
    """Dim 0 of the first input tensor with a dimension, or None when there is none."""
    from autopipe.profiler.inputs import batch_size_of

    try:
        return batch_size_of(inputs)
    except TypeError:
        return None


def _exit_text(exc: SystemExit) -> str:
    return f"called sys.exit({exc.code!r}); a model file must define functions, not exit"


def load_model_file(spec: str) -> ModelFile:
    """Import ``MODEL.py[:FACTORY]`` and find its factory, inputs and optional loss."""
    path_str, _, factory_name = spec.partition(":")
    factory_name = factory_name or "build_model"
    path = Path(path_str)
    if not path.is_file():
        what = not_a_regular_file(path)  # it exists: say what it is, not "not found"
        if what:
            raise ModelFileError(f"{path_str} is {what}, not a model file (give a .py file)")
        raise ModelFileError(f"model file not found: {path_str} (give a path to a .py file)")
    if path.suffix != ".py":
        raise ModelFileError(f"{path_str}: expected a Python file (MODEL.py[:FACTORY])")
    module = _import_path(path)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        found = factory_candidates(module)
        raise ModelFileError(
            f"{path.name} has no factory function {factory_name!r}; define it or name one "
            f"with {path.name}:FACTORY (factories in {path.name}: {', '.join(found) or 'none'})"
        )
    inputs_fn = getattr(module, f"example_inputs_{factory_name}", None) or getattr(
        module, "example_inputs", None
    )
    if not callable(inputs_fn):
        raise ModelFileError(
            f"{path.name} has no example_inputs(batch_size) function; define one returning a "
            "tensor, a tuple of tensors or a dict of keyword tensors"
        )
    loss_fn = getattr(module, "loss_fn", None)
    return ModelFile(
        path, factory_name, factory, inputs_fn, loss_fn if callable(loss_fn) else None, module
    )


NOT_FACTORIES = ("example_inputs", "loss_fn", "tp_plan")
"""Names a model file defines for other roles (``example_inputs_FACTORY`` included)."""


def factory_candidates(module: ModuleType) -> list[str]:
    """The functions of a model file that could be its FACTORY, sorted: defined in the file
    itself (not imported, as ``dataclass`` or ``torch.randn`` are), public, not one of the
    other roles (``example_inputs*``, ``loss_fn``), and callable with no arguments, as a
    factory is called. O(names in the file)."""
    found = []
    for name, value in vars(module).items():
        if name.startswith("_") or name.startswith(NOT_FACTORIES):
            continue
        if not inspect.isfunction(value) or value.__module__ != module.__name__:
            continue
        try:
            inspect.signature(value).bind()
        except TypeError:  # a required argument: the CLI could not call it
            continue
        found.append(name)
    return sorted(found)


def _import_path(path: Path) -> ModuleType:
    # The same name in every process (str hashes are salted per process): the model's class
    # then has one qualified name on all ranks, which the ranks compare at start-up.
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    name = f"autopipe_user_model_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    # Model files often import siblings (e.g. a shared config module).
    sys.path.insert(0, str(path.resolve().parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:
        sys.modules.pop(name, None)
        raise ModelFileError(f"importing {path} {_exit_text(exc)}") from exc
    except Exception as exc:
        sys.modules.pop(name, None)
        raise ModelFileError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.pop(0)
    return module
