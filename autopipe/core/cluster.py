"""Devices and links a plan is made for. Torch-free.

``Cluster.from_catalog`` builds one from the device catalog's datasheet figures
(``autopipe.core.catalog``, plain torch-free data): the planner reads the specs, the
catalog knows nothing of plans.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from autopipe.core.catalog import DeviceSpecError, get_device, parse_device_list

if TYPE_CHECKING:
    from autopipe.core.catalog import DeviceSpec


@dataclass
class Device:
    """One pipeline device.

    ``speed`` divides profiled times: 2.0 means this device runs every unit twice as
    fast as the device the profile was measured (or modelled) on.
    ``link_bandwidth_bytes_per_s``/``link_latency_s`` describe the link to the *next*
    device in pipeline order.
    """

    name: str = "cpu"
    memory_bytes: int | None = None
    speed: float = 1.0
    link_bandwidth_bytes_per_s: float = float("inf")
    link_latency_s: float = 0.0

    @classmethod
    def from_spec(
        cls, spec: str | DeviceSpec, *, memory_bytes: int | None = None, speed: float = 1.0
    ) -> Device:
        """The planner's view of a catalog device (a name or alias, or a ``DeviceSpec``): its
        memory capacity in bytes (``memory_bytes`` overrides it, e.g. to keep headroom) and its
        link to the next device. ``speed``: relative to the profiled device (see the class)."""
        spec = get_device(spec)
        return cls(
            name=spec.name,
            memory_bytes=spec.memory_bytes if memory_bytes is None else memory_bytes,
            speed=speed,
            link_bandwidth_bytes_per_s=spec.link_bandwidth_bytes_per_s,
            link_latency_s=spec.link_latency_s,
        )


@dataclass
class Cluster:
    """Devices in pipeline order; stage ``i`` runs on ``devices[i]``."""

    devices: list[Device] = field(default_factory=list)
    host_throughput: float | None = None
    """The devices share one host that runs at most this many of them at full speed at once,
    in units of one device: while ``n`` of them compute, each runs at
    ``min(1, host_throughput / n)`` of its speed. For ranks that are processes on one
    machine's CPU cores (measure it: ``n x`` one process's time alone over its time while
    ``n`` run the same work). None (the default): every device is dedicated, as GPUs are."""

    @classmethod
    def homogeneous(
        cls,
        count: int,
        name: str = "cpu",
        memory_bytes: int | None = None,
        link_bandwidth_bytes_per_s: float = float("inf"),
        link_latency_s: float = 0.0,
        host_throughput: float | None = None,
    ) -> Cluster:
        return cls(
            [
                Device(name, memory_bytes, 1.0, link_bandwidth_bytes_per_s, link_latency_s)
                for _ in range(count)
            ],
            host_throughput,
        )

    @classmethod
    def from_catalog(
        cls,
        devices: str | DeviceSpec | Sequence[tuple[str | DeviceSpec, int]],
        count: int | None = None,
        *,
        memory_bytes: int | None = None,
        speeds: Mapping[str, float] | None = None,
    ) -> Cluster:
        """Catalog devices in pipeline order, with their datasheet memory and links.

        ``devices``: one device (a catalog name or alias, or a ``DeviceSpec``) repeated
        ``count`` times (default 1), e.g. ``from_catalog("h100-sxm", 8)``; or a mixed cluster
        as ``(device, count)`` pairs or the CLI's ``"a100-80gb:4,v100-32gb:4"`` (then no
        ``count``). ``memory_bytes`` replaces every device's capacity (``--memory``).
        ``speeds``: per canonical device name (``"V100-32GB"``), how many times faster than
        the profiled device it runs the profile's units (default 1.0; a mixed cluster's
        speeds come from re-pricing the profile, ``autopipe.device_target.cluster_for``).
        Raises ``DeviceSpecError`` for an unknown device or a count below 1.
        """
        entries: Sequence[tuple[str | DeviceSpec, int]]
        if isinstance(devices, str):
            listed = ":" in devices or "," in devices
            entries = (
                parse_device_list(devices) if listed else [(devices, 1 if count is None else count)]
            )
        elif isinstance(devices, Sequence):
            listed, entries = True, cast("Sequence[tuple[str | DeviceSpec, int]]", devices)
        else:
            listed, entries = False, [(devices, 1 if count is None else count)]
        if listed and count is not None:
            raise DeviceSpecError("a device list carries its counts: drop count=")
        out: list[Device] = []
        for device, n in entries:
            if n < 1:
                raise DeviceSpecError(f"device count must be >= 1, got {n}")
            spec = get_device(device)
            speed = (speeds or {}).get(spec.name, 1.0)
            # One Device per stage, not one shared object: a caller may adjust one stage's.
            out += [
                Device.from_spec(spec, memory_bytes=memory_bytes, speed=speed) for _ in range(n)
            ]
        return cls(out)

    def __len__(self) -> int:
        return len(self.devices)

    def sharing(self, num_ranks: int) -> float | None:
        """``host_throughput`` when it slows ``num_ranks`` busy ranks down (below
        ``num_ranks``), else None: a host with room for every rank is as good as dedicated."""
        h = self.host_throughput
        return h if h is not None and h < num_ranks else None
