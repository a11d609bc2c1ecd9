"""Which devices a model is profiled on and a plan is made for: what ``--device`` and
``--device-spec`` mean, as library functions (the CLI only calls them).

The forms a device takes:

* a local torch device to *measure* on: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``;
* a catalog device to *count* the model for analytically (``autopipe devices`` lists them):
  ``"a100-80gb"``; or your own spec, ``device_spec="my_gpu.yaml"`` (YAML or JSON);
* a mixed cluster in pipeline order, ``"a100-80gb:4,v100-32gb:4"``: the model is counted on
  the first kind, and the profile re-priced for every other kind to find its speed.

Typical use::

    target = resolve_devices("a100-80gb:4,v100-32gb:4")
    profile = profile_analytic(model, inputs, target.counted_on, AnalyticOptions(dtype="float16"))
    cluster = cluster_for(profile, 8, target)
    plan = autopipe.plan(profile, autopipe.PlanRequest(cluster=cluster))

Torch-free: resolving names, reading spec files and re-pricing read datasheet figures only
(:func:`check_local_device`, which asks torch whether a local device exists, imports it when
called).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autopipe.core.catalog import (
    DeviceSpec,
    DeviceSpecError,
    get_device,
    is_catalog_device,
    load_device_spec,
    parse_device_counts,
    parse_device_list,
)
from autopipe.core.cluster import Cluster
from autopipe.core.errors import UsageError
from autopipe.core.profile import Profile
from autopipe.profiler.calibrate import reprice

LOCAL_DEVICES = ("cpu", "mps")
"""Names that mean "measure on this machine", besides ``cuda`` and ``cuda:i`` (the nominal
catalog CPU is ``"cpu-nominal"``)."""


@dataclass(frozen=True)
class DeviceTarget:
    """What ``--device`` / ``--device-spec`` ask for: measure on a local device, or count the
    model for a spec (and, for a mixed cluster, the kinds in pipeline order)."""

    measure_on: str | None = None
    """The local torch device to measure on (``"cpu"``, ``"cuda:1"``); None: the profiler's
    default. Meaningful only when ``counted_on`` is None."""
    counted_on: DeviceSpec | None = None
    """The spec the model is counted for (analytic profiling); None: measure it."""
    pipeline: tuple[tuple[DeviceSpec, int], ...] = ()
    """A ``NAME:COUNT,...`` list: each kind with its count, in pipeline order; empty otherwise."""

    @property
    def analytic(self) -> bool:
        """Whether the model is counted (analytic) rather than measured."""
        return self.counted_on is not None

    @property
    def listed_devices(self) -> int | None:
        """How many devices the ``NAME:COUNT,...`` list names; None without a list."""
        return sum(n for _, n in self.pipeline) if self.pipeline else None

    @property
    def gpus_per_node(self) -> int | None:
        """Devices per node of the one kind counted for (its platform's, from the catalog or
        the spec file); None for a list of kinds or a local device."""
        if self.counted_on is None or self.pipeline:
            return None
        return self.counted_on.gpus_per_node


def is_local_device(name: str) -> bool:
    """Whether ``name`` means a device of this machine to measure on (``cpu``, ``mps``,
    ``cuda``, ``cuda:i``), as opposed to a catalog device to count for."""
    return name in LOCAL_DEVICES or name.startswith("cuda")


def device_counts(device: str | None) -> list[tuple[str, int]] | None:
    """The ``NAME[:COUNT],...`` entries of a device list, names not yet looked up (cheap: for
    checking counts before any profiling); None when ``device`` is one device or none.

    ``"a100-80gb"`` is one device; ``"a100-80gb:1"`` is a list of one; a name starting with
    ``cuda``, ``cpu`` or ``mps`` is never a list (``cuda:1`` is a device index). Raises
    ``DeviceListError`` for a malformed list.
    """
    if not device or device.startswith(("cuda", "cpu", "mps")):
        return None
    if "," not in device and ":" not in device:
        return None
    return parse_device_counts(device)


def resolve_devices(
    device: str | None = None, device_spec: str | Path | DeviceSpec | None = None
) -> DeviceTarget:
    """What ``device`` (a local device, a catalog name, or a ``NAME:COUNT,...`` list) and
    ``device_spec`` (a spec file, or a ``DeviceSpec``) ask for; see the module docstring.

    A spec file wins over a catalog name as the device to count on (a list still gives the
    pipeline's kinds). Raises ``DeviceSpecError`` (``DeviceListError`` for a malformed list)
    for unknown names and unreadable or invalid spec files.
    """
    # The spec file is read first: its errors come before the list's.
    spec: DeviceSpec | None = None
    if isinstance(device_spec, DeviceSpec):
        spec = device_spec
    elif device_spec:
        spec = load_device_spec(device_spec)
    pipeline = tuple(parse_device_list(device)) if device and device_counts(device) else ()
    if spec is not None:
        return DeviceTarget(counted_on=spec, pipeline=pipeline)
    if pipeline:  # counted on the first kind, re-priced for the others
        return DeviceTarget(counted_on=pipeline[0][0], pipeline=pipeline)
    if device is None or is_local_device(device):
        return DeviceTarget(measure_on=device)
    return DeviceTarget(counted_on=get_device(device))


def profiled_on(profile: Profile, device: str) -> bool:
    """Whether ``device`` (a ``--device`` name) is the device ``profile`` was measured on, or
    (a catalog name or alias) the one it was counted for."""
    if profile.mode != "analytic":
        return device == profile.device
    try:
        return get_device(device).name == profile.device
    except ValueError:
        return False


def check_local_device(name: str, flag: str) -> None:
    """Refuse (``UsageError`` naming ``flag``) a ``name`` that is no torch device this machine
    has: not a device at all, ``meta`` (it holds no data), or a CUDA index past the last."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"{flag}: {name!r} is not a torch device (e.g. cpu, cuda:0)") from None
    if device.type == "meta":
        raise UsageError(f"{flag}: the meta device holds no data; nothing can run on it")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(
            f"{flag}: {name} is not here: this machine has "
            f"{torch.cuda.device_count()} CUDA device(s)"
        )


def reprice_for(profile: Profile, device: str | DeviceSpec) -> Profile:
    """The analytic ``profile`` with its times re-priced for ``device`` (a catalog name or a
    spec) without re-counting the model: O(units). The profile itself when it was counted on
    that device. Raises ``CalibrationError`` for a measured profile or a device without a peak
    for the profile's dtype, ``DeviceSpecError`` for an unknown name."""
    spec = get_device(device)
    return profile if spec.name == profile.device else reprice(profile, spec)


def relative_speed(profile: Profile, device: str | DeviceSpec) -> float:
    """How many times faster than the device it was counted on ``device`` runs the analytic
    ``profile``'s units (forward plus backward seconds, summed): the planner's
    ``Device.speed``."""
    base_s = sum(u.forward_s + u.backward_s for u in profile.units)
    repriced = reprice_for(profile, device)
    return base_s / sum(u.forward_s + u.backward_s for u in repriced.units)


def cluster_for(
    profile: Profile,
    gpus: int,
    devices: DeviceTarget | str | None = None,
    *,
    memory_bytes: int | None = None,
) -> Cluster | None:
    """The devices to plan ``profile`` for on ``gpus`` pipeline stages, or None.

    * a mixed list (``"a100-80gb:4,v100-32gb:4"``, or a target with a ``pipeline``): each
      kind's memory and link from its spec, its speed from re-pricing the analytic profile
      for it (:func:`relative_speed`); the list must name ``gpus`` devices;
    * an analytic profile: ``gpus`` of the spec it was counted for (``devices``' spec, else
      the catalog device the profile names), with that spec's memory and link;
    * a measured profile (or an analytic one for a spec not in the catalog): None, plan with
      ``gpus`` and ``memory_per_device`` instead.

    ``memory_bytes`` replaces every device's capacity (``--memory``). Raises ``ValueError``
    (``DeviceSpecError``, ``CalibrationError``) for lists the profile cannot be priced for.
    """
    target = resolve_devices(devices) if isinstance(devices, str) or devices is None else devices
    if target.pipeline:
        if profile.mode != "analytic":
            raise DeviceSpecError(
                "a device list needs analytic costs: profile with --device NAME (a catalog device)"
            )
        if target.listed_devices != gpus:
            raise DeviceSpecError(
                f"the device list names {target.listed_devices} devices but gpus is {gpus}"
            )
        speeds = {spec.name: relative_speed(profile, spec) for spec, _ in target.pipeline}
        return Cluster.from_catalog(list(target.pipeline), memory_bytes=memory_bytes, speeds=speeds)
    spec = target.counted_on
    if spec is None and profile.mode == "analytic" and is_catalog_device(profile.device):
        spec = get_device(profile.device)
    if spec is None:
        return None
    return Cluster.from_catalog(spec, gpus, memory_bytes=memory_bytes)
