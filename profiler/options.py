"""What a profile is asked for, as one typed value: :class:`MeasureOptions` (measured)
and :class:`AnalyticOptions` (counted).

Torch-free. ``autopipe.profiler.measure.profile(model, inputs, MeasureOptions(...))`` takes the
first, and the same options, resolved for the machine (the device, dtype, thread count and
clock actually used), are the profile cache's key: two runs that would measure the same
thing find the same cached profile, and nothing else does.
``autopipe.profiler.analytic.profile_analytic(model, inputs, device, AnalyticOptions(...))``
takes the second.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["AnalyticOptions", "MeasureOptions"]


@dataclass(frozen=True)
class MeasureOptions:
    """How to measure. ``None`` means "derive it" (from the model, the device, the host)."""

    device: str | None = None
    """Where to measure (``"cpu"``, ``"cuda:1"``); default: where the model is."""
    dtype: str | None = None
    """Cast the model and floating inputs (``"bfloat16"``); default: the model's dtype."""
    granularity: str = "block"
    """What a unit is: ``"block"``, ``"module"`` or ``"node"``."""
    units: tuple[str, ...] = ()
    """fnmatch patterns over module paths naming the units instead (``"model.layers.*"``)."""
    tracer: str | None = None
    """Force ``"fx"``, ``"export"`` or ``"hooks"`` instead of the fallback chain."""
    warmup: int = 2
    repeat: int = 5
    microbatch_sizes: tuple[int, ...] | None = None
    """Smaller batch sizes also timed for the ``t(b) = a + c b`` fit (``()``: none)."""
    optimizer: str = "auto"
    bytes_per_parameter: float | None = None
    threads: int | None = None
    """torch's intra-op threads while measuring (``None``: 1 on CPU)."""
    clock: str | Callable[[], float] = "auto"
    """``"wall"``, ``"thread_cpu"``, ``"cuda_events"``, ``"auto"`` or a function (tests)."""
    share: bool = True
    """Measure identical units once."""
    reference: bool | None = None
    """Also time the whole model in one piece (``None``: when nothing is shared)."""
    meta_init: bool | None = None
    """Measure a meta-device model unit by unit (``None``: when the model is on meta)."""
    split_backward: bool = True
    """Also time each unit's backward split into its input gradient (B) and its weight
    gradient (W), as the zero-bubble schedules run them, at every micro-batch size timed
    (one more forward + backward per unit per round)."""
    scale_to_reference: bool = False
    """Scale the units' times so they add up to the whole model timed in one piece (implies
    ``reference``): a unit timed alone, on its own inputs again and again, runs with its
    weights and inputs hot in cache, faster than in the model's chain. The factors are kept
    in ``Profile.measurement.reference_scale``."""
    compile: bool = False
    """Time each unit as the trainer runs it when it ``torch.compile``'s its stages: each
    measured unit's submodule (and the whole-model reference) wrapped in ``torch.compile``
    (default inductor, ``dynamic=False``), so fused element-wise ops are timed as the fused
    kernels, and saved bytes are what the compiled unit saves. Each measured unit compiles
    once per micro-batch size, in the untimed capture pass and the warm-up runs (needs
    ``warmup >= 1``); the split backward (B/W) is not timed (torch runs no compiled stage
    in the split-backward schedules). Recorded in ``Profile.measurement.compile``."""

    def __post_init__(self) -> None:
        # torch.device / torch.dtype arguments, lists for tuples: kept as plain values.
        for name in ("device", "dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                text = str(value).removeprefix("torch.")
                object.__setattr__(self, name, text)
        object.__setattr__(self, "units", tuple(self.units or ()))
        if self.microbatch_sizes is not None:
            object.__setattr__(self, "microbatch_sizes", tuple(self.microbatch_sizes))
        if self.warmup < 0 or self.repeat < 1:
            raise ValueError(
                f"need warmup >= 0 and repeat >= 1, got warmup={self.warmup}, repeat={self.repeat}"
            )
        if self.bytes_per_parameter is not None and not self.bytes_per_parameter > 0:
            raise ValueError(f"bytes_per_parameter={self.bytes_per_parameter} must be positive")
        if self.compile and self.warmup < 1:
            # The first backward of a compiled unit compiles its backward graph: never timed.
            raise ValueError("compile=True needs warmup >= 1: the first runs compile the units")

    @property
    def times_split_backward(self) -> bool:
        """Whether the backward's B/W split is timed: asked (``split_backward``) and not
        compiled (torch runs no compiled stage in the split-backward schedules)."""
        return self.split_backward and not self.compile

    def key(self) -> dict[str, Any]:
        """The options as the cache key's plain values (a clock function by its name)."""
        data = dataclasses.asdict(self)
        if callable(self.clock):
            data["clock"] = getattr(self.clock, "__qualname__", "custom")
        return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}


@dataclass(frozen=True)
class AnalyticOptions:
    """How to count a profile on the meta device for a catalog device
    (:func:`autopipe.profiler.analytic.profile_analytic`)."""

    dtype: str = "bfloat16"
    """Floating inputs and parameters are cast to it (``"bfloat16"``, ``"float16"``,
    ``"float32"``)."""
    granularity: str = "block"
    """What a unit is: ``"block"``, ``"module"`` or ``"node"``."""
    units: tuple[str, ...] = ()
    """fnmatch patterns over module paths naming the units instead (``"model.layers.*"``)."""
    microbatch_sizes: tuple[int, ...] | None = None
    """Sizes also counted to fit ``t(b) = a + c * b`` per unit; ``None``: ``B`` and ``B/4``
    (or ``B/2``); ``()``: ``B`` only (the per-call part is then kernels x launch overhead)."""
    efficiency: float | Mapping[str, float] | None = None
    """A float sets the device's compute efficiency; a mapping may set ``compute``,
    ``memory`` and ``kernel_launch_overhead_s``; None: the catalog's."""
    optimizer: str = "auto"
    """Training state per parameter (``auto``: mixed-precision Adam for 16-bit parameters,
    Adam for fp32; ``autopipe/core/optimizer.py``)."""
    bytes_per_parameter: float | None = None
    """Training-state bytes per parameter instead of ``optimizer``'s."""
    allow_tf32: bool = False
    """Price fp32 matrix products at the device's TF32 peak."""
    share: bool = True
    """Count a stack of repeated blocks as its first few blocks and repeat the counts
    (:mod:`autopipe.profiler.reduce`); ``False`` counts every block."""
    model_name: str = ""
    """The profile's model name (default: the model's class name)."""

    def __post_init__(self) -> None:
        # Lists for tuples: kept as plain, immutable values.
        object.__setattr__(self, "units", tuple(self.units or ()))
        if self.microbatch_sizes is not None:
            object.__setattr__(self, "microbatch_sizes", tuple(self.microbatch_sizes))
