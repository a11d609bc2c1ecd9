"""Devices and links a plan is made for. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class Cluster:
    """Devices in pipeline order; stage ``i`` runs on ``devices[i]``."""

    devices: list[Device] = field(default_factory=list)

    @classmethod
    def homogeneous(
        cls,
        count: int,
        name: str = "cpu",
        memory_bytes: int | None = None,
        link_bandwidth_bytes_per_s: float = float("inf"),
        link_latency_s: float = 0.0,
    ) -> Cluster:
        return cls(
            [
                Device(name, memory_bytes, 1.0, link_bandwidth_bytes_per_s, link_latency_s)
                for _ in range(count)
            ]
        )

    def __len__(self) -> int:
        return len(self.devices)
