"""Profile a model file (``MODEL.py[:FACTORY]``) as ``autopipe profile`` and ``autopipe plan
MODEL.py`` do, for the CLI and the Python API alike.

The devices come resolved (:func:`autopipe.device_target.resolve_devices`, once): a catalog
device or spec is *counted* for (:func:`autopipe.profiler.analytic.profile_analytic`),
anything else is *measured* on a local device (:func:`autopipe.profiler.measure.profile`),
one unit at a time from meta when the model would not fit that device's free memory.
What the model's own code raises on its example inputs is bad input (a ``UsageError``),
not an autopipe failure; running out of memory is a failure.

Typical use::

    devices = resolve_devices("a100-80gb")
    profile = profile_model_file("examples/gpt.py", devices, ProfileRequest(dtype="float16"))
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopipe.core.catalog import DeviceSpecError
from autopipe.core.errors import UsageError
from autopipe.core.humanize import format_bytes
from autopipe.device_target import check_local_device
from autopipe.modelfile import ModelFile, ModelFileError, load_model_file
from autopipe.profiler.options import AnalyticOptions, MeasureOptions

if TYPE_CHECKING:
    from torch import nn

    from autopipe.core.profile import Profile
    from autopipe.device_target import DeviceTarget

__all__ = [
    "MODEL_ERRORS",
    "ProfileRequest",
    "available_memory_bytes",
    "check_counting_request",
    "annotate_tp_refusal",
    "model_failed",
    "profile",
    "profile_model_file",
    "too_big_to_build",
]

log = logging.getLogger("autopipe")

MODEL_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, KeyError)
"""What a model's own code raises on inputs it cannot take (wrong shapes or dtypes)."""


@dataclass(frozen=True)
class ProfileRequest:
    """How to profile a model file (the flags of ``autopipe profile``). ``None``: the
    default the profiler derives."""

    batch_size: int | None = None
    """The mini-batch B of the example inputs; None: ``example_inputs``' own default."""
    dtype: str | None = None
    """Counted: the dtype whose peak prices the model (None: ``bfloat16``). Measured: unused."""
    granularity: str | None = None
    """What a unit is: ``block`` (None), ``module`` or ``node``."""
    units: tuple[str, ...] = ()
    """fnmatch patterns over module paths naming the units instead (``model.layers.*``)."""
    cache: bool = True
    """Measured: reuse a cached profile of the same model, inputs and options."""
    optimizer: str = "auto"
    """Whose training state each parameter carries (``autopipe/core/optimizer.py``)."""
    bytes_per_parameter: float | None = None
    """Training-state bytes per parameter; overrides ``optimizer``."""
    share: bool = True
    """Measure (or count) identical units once."""
    split_backward: bool = True
    """Measured: also time each unit's backward split into input and weight gradients."""
    scale_to_reference: bool = False
    """Measured: scale the units' times to add up to the whole model timed in one piece."""
    meta_init: bool = False
    """Measured: build on meta and measure one unit at a time (also chosen automatically
    when parameters and gradients would not fit the device's free memory)."""
    compile: bool = False
    """Measured: time each unit ``torch.compile``'d (``MeasureOptions.compile``); refused
    when counting, whose count it cannot change."""
    progress: bool = True
    """Show progress bars."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple(self.units or ()))


def profile_model_file(
    model: str | ModelFile, devices: DeviceTarget, request: ProfileRequest | None = None
) -> Profile:
    """The Profile of the model file ``model`` (``MODEL.py[:FACTORY]``, or one loaded with
    :func:`autopipe.modelfile.load_model_file`): counted for ``devices.counted_on``, else
    measured on ``devices.measure_on`` (which must exist here). ``Profile.model`` is the
    file's label. Raises ``UsageError`` for a bad file, request or model; a model that runs
    out of memory raises torch's ``OutOfMemoryError``."""
    from autopipe.profiler.analytic import AnalyticProfileError
    from autopipe.profiler.measure import ProfilingError
    from autopipe.profiler.trace import TraceError
    from autopipe.profiler.units import UnitPatternError

    request = request or ProfileRequest()
    # What the devices cannot do is refused before the model file is imported (importing
    # torch and the model's own imports takes seconds).
    if devices.counted_on is not None:
        check_counting_request(devices, request)
    elif devices.measure_on is not None:
        check_local_device(devices.measure_on, "--device")
    mf = model if isinstance(model, ModelFile) else _load(model)
    batch_size = request.batch_size or mf.default_batch_size()
    try:
        if devices.counted_on is not None:
            profile = _count(mf, batch_size, devices, request)
        else:
            profile = _measure(mf, batch_size, devices, request)
    except (
        ModelFileError,
        AnalyticProfileError,
        DeviceSpecError,
        TraceError,
        ProfilingError,
        UnitPatternError,
    ) as exc:
        raise UsageError(str(exc)) from exc
    except MODEL_ERRORS as exc:
        raise model_failed(mf, batch_size, exc) from exc
    profile.model = mf.label
    return profile


def profile(model: nn.Module, example_inputs: Any, *args: Any, **kwargs: Any) -> Profile:
    """``autopipe.profile``: :func:`autopipe.profiler.measure.profile` (same arguments), then
    :func:`annotate_tp_refusal`, so the planner refuses at plan time a T > 1 the mesh runtime
    cannot run."""
    from autopipe.profiler.measure import profile as measure

    return annotate_tp_refusal(
        measure(model, example_inputs, *args, **kwargs), model, example_inputs
    )


def annotate_tp_refusal(profile: Profile, model: nn.Module, example_inputs: Any) -> Profile:
    """Set ``profile.tp_refusal`` (in place; returns ``profile``): why the mesh runtime cannot
    run ``model`` at T > 1 (:func:`autopipe.runtime.distributed.tp_check.tp_refusal`, the
    runtime's own start-up analysis, once), or None. Here, not in the profiler: the profiler
    does not import the runtime (data flows profiler -> planner -> runtime)."""
    from autopipe.runtime.distributed.tp_check import tp_refusal

    profile.tp_refusal = tp_refusal(model, example_inputs, profile)
    return profile


def _load(spec: str) -> ModelFile:
    try:
        return load_model_file(spec)
    except ModelFileError as exc:
        raise UsageError(str(exc)) from exc


def _count(
    mf: ModelFile, batch_size: int | None, devices: DeviceTarget, request: ProfileRequest
) -> Profile:
    """The model counted on meta for ``devices.counted_on`` (no device needed)."""
    from autopipe.profiler.analytic import profile_analytic

    assert devices.counted_on is not None
    model = mf.build(device="meta")
    inputs = mf.inputs(batch_size)
    options = AnalyticOptions(
        dtype=request.dtype or "bfloat16",
        granularity=request.granularity or "block",
        optimizer=request.optimizer,
        bytes_per_parameter=request.bytes_per_parameter,
        share=request.share,
        units=tuple(request.units),
    )
    counted = profile_analytic(
        model,
        inputs,
        devices.counted_on,
        options,
        loss_fn=mf.loss_fn,
        progress=request.progress,
        tp_plan=mf.tp_plan,
    )
    return annotate_tp_refusal(counted, model, inputs)


def _measure(
    mf: ModelFile, batch_size: int | None, devices: DeviceTarget, request: ProfileRequest
) -> Profile:
    """The model measured on ``devices.measure_on`` (unit by unit from meta when asked, or
    when it would not fit)."""
    from autopipe.profiler.measure import profile

    meta_init = request.meta_init or too_big_to_build(mf, devices.measure_on)
    model = mf.build(device="meta" if meta_init else None)
    inputs = mf.inputs(batch_size)
    options = MeasureOptions(
        device=devices.measure_on,
        granularity=request.granularity or "block",
        units=request.units,
        optimizer=request.optimizer,
        bytes_per_parameter=request.bytes_per_parameter,
        meta_init=meta_init,
        share=request.share,
        split_backward=request.split_backward,
        scale_to_reference=request.scale_to_reference,
        compile=request.compile,
    )
    measured = profile(
        model,
        inputs,
        options,
        loss_fn=mf.loss_fn,
        progress=request.progress,
        cache=request.cache and not meta_init,
        tp_plan=mf.tp_plan,
    )
    return annotate_tp_refusal(measured, model, inputs)


def check_counting_request(devices: DeviceTarget, request: ProfileRequest) -> None:
    """Refuse, before any model is built, what counting for ``devices`` cannot do: measuring
    from meta (``meta_init``) or compiled (``compile``), and a ``dtype`` (default bfloat16)
    that a device of the spec or the list has no peak for. Raises ``UsageError``."""
    if request.meta_init:
        raise UsageError(
            "--meta-init measures unit by unit; with --device NAME nothing is measured "
            "(the model is counted on meta anyway): drop one of them"
        )
    if request.compile:
        raise UsageError(
            "--compile applies to measured profiles: with --device NAME the model is counted "
            "(element-wise ops unfused), which compiling cannot change; measure on a local "
            "device, or drop --compile"
        )
    dtype = request.dtype or "bfloat16"
    specs = [s for s in (devices.counted_on, *(s for s, _ in devices.pipeline)) if s is not None]
    for spec in specs:
        try:
            spec.peak_for(dtype)
        except DeviceSpecError as exc:
            flag = "--dtype" if request.dtype else "the default --dtype bfloat16"
            raise UsageError(f"{flag}: {exc}") from exc


def model_failed(mf: ModelFile, batch_size: int | None, exc: BaseException) -> UsageError:
    """The UsageError for a model that failed on its example inputs: bad input, whichever
    command ran it (profile, plan, bench), not an autopipe failure. Out of memory is no bad
    input: it is re-raised (exit 1)."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        raise exc
    return UsageError(
        f"{mf.label}: the model failed on example_inputs({batch_size or ''}): "
        f"{type(exc).__name__}: {exc}"
    )


def available_memory_bytes(device: str | None) -> int | None:
    """Free memory of the profiling device in bytes: ``torch.cuda.mem_get_info`` on CUDA,
    else the host's ``MemAvailable`` (Linux); None when unknown."""
    import torch

    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def too_big_to_build(mf: ModelFile, device: str | None) -> bool:
    """Whether the model's parameters and their gradients would not fit in the profiling
    device's free memory, so it must be measured unit by unit from the meta device (what
    ``--meta-init`` asks for). Builds the model on meta to count its bytes: O(parameters)."""
    try:
        model: Any = mf.build(device="meta")
    except Exception:  # a factory that cannot run on meta is built for real
        return False
    state = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    free = available_memory_bytes(device)
    if free is None or 2 * state <= free:
        return False

    log.info(
        "%s holds %s of parameters and buffers; with gradients that is more than the %s free "
        "on %s, so it is built on meta and measured one unit at a time (--meta-init)",
        mf.label,
        format_bytes(state),
        format_bytes(free),
        device or "cpu",
    )
    return True
