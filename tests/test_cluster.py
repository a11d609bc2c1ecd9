"""autopipe.core.cluster: devices in pipeline order, from the catalog or by hand."""

from __future__ import annotations

import pytest

from autopipe.core.catalog import DeviceSpecError, get_device
from autopipe.core.cluster import Cluster, Device


def test_homogeneous_gives_equal_independent_devices() -> None:
    c = Cluster.homogeneous(3, "x", 10**9, 2e9, 1e-6)
    assert len(c) == 3 and c.host_throughput is None
    assert all(d == Device("x", 10**9, 1.0, 2e9, 1e-6) for d in c.devices)
    c.devices[0].speed = 2.0  # one stage adjusted: the others are separate objects
    assert [d.speed for d in c.devices] == [2.0, 1.0, 1.0]


def test_from_catalog_reads_a_mixed_list_in_pipeline_order() -> None:
    a100, v100 = get_device("a100-80gb"), get_device("v100-32gb")
    c = Cluster.from_catalog("a100-80gb:2,v100-32gb:1", speeds={"V100-32GB": 0.5})
    assert [d.name for d in c.devices] == [a100.name, a100.name, v100.name]
    assert [d.memory_bytes for d in c.devices] == [a100.memory_bytes] * 2 + [v100.memory_bytes]
    assert [d.speed for d in c.devices] == [1.0, 1.0, 0.5]
    assert c.devices[2].link_bandwidth_bytes_per_s == v100.link_bandwidth_bytes_per_s
    pairs = Cluster.from_catalog([("a100-80gb", 2), (v100, 1)], speeds={"V100-32GB": 0.5})
    assert pairs == c
    assert c.devices[0] is not c.devices[1]


def test_from_catalog_refuses_a_count_beside_a_list() -> None:
    with pytest.raises(DeviceSpecError, match="a device list carries its counts: drop count="):
        Cluster.from_catalog("a100-80gb:2", 2)
    with pytest.raises(DeviceSpecError, match="count must be >= 1, got -1"):
        Cluster.from_catalog([("a100-80gb", -1)])


def test_from_spec_memory_override_and_speed() -> None:
    d = Device.from_spec(get_device("v100-32gb"), memory_bytes=123, speed=3.0)
    assert (d.memory_bytes, d.speed) == (123, 3.0)


@pytest.mark.parametrize(
    ("host", "ranks", "expected"),
    [(None, 4, None), (2.0, 4, 2.0), (4.0, 4, None), (6.0, 4, None), (1.5, 2, 1.5)],
)
def test_sharing_only_when_the_host_slows_the_ranks(
    host: float | None, ranks: int, expected: float | None
) -> None:
    assert Cluster.homogeneous(ranks, host_throughput=host).sharing(ranks) == expected
