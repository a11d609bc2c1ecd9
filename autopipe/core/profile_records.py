"""How a profile was made, as typed records the Profile keeps.

Torch-free. JSON form by ``dataclasses.asdict``; ``from_dict`` ignores keys a newer writer
added (schema v1 stays additive). Times are seconds, sizes bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autopipe.core.datafile import known_fields

__all__ = ["CountedBlocks", "Counting", "Measurement", "SizeMeasurement"]


@dataclass
class SizeMeasurement:
    """The units measured at one micro-batch size (what the ``t(b) = a + c b`` fit used)."""

    microbatch_size: int
    forward_s: list[float] = field(default_factory=list)
    """Per unit, in unit order."""
    backward_s: list[float] = field(default_factory=list)
    activation_bytes: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SizeMeasurement:
        return cls(**known_fields(cls, data))


@dataclass
class Measurement:
    """How the measuring profiler ran (``Profile.measurement``; None for a counted profile)."""

    microbatch_sizes: list[int] = field(default_factory=list)
    """The batch sizes timed, the profile's own first."""
    warmup: int = 0
    repeat: int = 0
    threads: int = 0
    """torch's intra-op threads while measuring."""
    clock: str = ""
    """The clock the times were read from (``wall``, ``thread_cpu``, ``cuda``, ...)."""
    host: str = ""
    reference: bool = False
    """Whether the whole model was also timed in one piece (``Profile.total_forward_s``)."""
    reference_scale: dict[str, float] = field(default_factory=dict)
    """``{"forward": f, "backward": b}``: the factors the units' times were scaled by to add
    up to the reference (``scale_to_reference``); empty when they were not scaled."""
    shared_samples_cap: int = 0
    """Most repeats a shared measurement takes its samples from (1: sharing off)."""
    meta_init: bool = False
    """The model was built on the meta device and measured one unit at a time."""
    compile: bool = False
    """The units were timed ``torch.compile``'d (``MeasureOptions.compile``): element-wise ops
    fused as the compiled trainer runs them; False: eager, unfused; no B/W split timed."""
    materialized_peak_bytes: int = 0
    """The most device memory the units materialized at once held (meta-init)."""
    per_size: list[SizeMeasurement] = field(default_factory=list)
    """Each timed size's per-unit figures, in ``microbatch_sizes`` order."""

    def __post_init__(self) -> None:
        self.per_size = [
            s if isinstance(s, SizeMeasurement) else SizeMeasurement.from_dict(s)
            for s in self.per_size
        ]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Measurement:
        return cls(**known_fields(cls, data))


@dataclass
class CountedBlocks:
    """A counted profile of a long block stack counted in part (``profiler/reduce.py``):
    ``counted`` of the ``blocks`` blocks of ``container`` were counted, the rest copied
    (``head`` blocks before the repeating ``period``)."""

    container: str
    blocks: int
    counted: int
    head: int = 0
    period: int = 1

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CountedBlocks:
        return cls(**known_fields(cls, data))


@dataclass
class Counting:
    """How the analytic profiler counted (``Profile.counting``; None for a measured profile):
    the per-unit cost parts the times were priced from, kept so that ``profiler/calibrate.py``
    can re-price them for another device without counting the model again.

    A cost part is ``{"forward": phase, "backward": phase}`` with each phase
    ``{"compute_s", "memory_s", "kernels", "flops", ...}`` (``profiler/opcount.py``):
    seconds bound by FLOP/s and by bandwidth on ``device_spec``, and kernel launches.
    """

    device_spec: dict[str, Any] = field(default_factory=dict)
    """The ``DeviceSpec`` the parts were priced with, as plain data (``DeviceSpec.to_dict``)."""
    units: list[dict[str, Any]] = field(default_factory=list)
    """One cost part per unit at ``Profile.batch_size``, in unit order, each with its
    unit's ``name``."""
    smaller_sizes: list[dict[str, Any]] = field(default_factory=list)
    """``{"microbatch_size": b, "units": [part per unit..., the loss's part]}`` for each
    smaller size counted (what the per-call overhead ``a`` of ``t(b) = a + c b`` is fitted
    from); empty when only the profile's own batch size was counted."""
    loss: dict[str, Any] = field(default_factory=dict)
    """The loss's cost part at ``Profile.batch_size`` (empty: none counted)."""
    seconds: float = 0.0
    """Wall-clock seconds the analytic profiler took."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Counting:
        return cls(**known_fields(cls, data))
